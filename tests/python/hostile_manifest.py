#!/usr/bin/python3
"""load_checkpoint on crafted manifests (issue 25, point 1): a depth bomb (an unsealed
{"format": [[[...]]]} nested 100,000 deep crashed the interpreter), a size bomb (5 million values,
quoted whole in the message) and a sealed manifest whose param_dtype holds terminal escape
sequences. Each raises strata.InvalidArgumentError with a short message naming manifest.json and
free of control characters; the optimizer is unchanged and still trains.
Run with /usr/bin/python3, PYTHONPATH=<build>/python.
"""
import json
import os
import re
import tempfile
import unittest

import torch

import strata


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def seal(obj):
    obj.pop("manifest_crc32c", None)
    body = json.dumps(obj, indent=1)[:-2]
    return body + ',\n "manifest_crc32c": "%08x"\n}\n' % crc32c(body.encode())


class HostileManifest(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 4)
        self.opt = strata.torch.ZeroOptimizer(self.model, {"zero": {"stage": 1}, "runtime": {"cpu_threads": 1}})
        self.step()

    def tearDown(self):
        self.opt.close()

    def step(self):
        loss = self.model(torch.ones(2, 8)).square().sum()
        self.opt.backward(loss)
        self.opt.step()

    def refused(self, directory, want):
        before = {k: v.clone() for k, v in self.model.state_dict().items()}
        with self.assertRaises(strata.InvalidArgumentError) as cm:
            self.opt.load_checkpoint(directory)
        msg = str(cm.exception)
        self.assertIn("manifest.json", msg)
        self.assertIn(want, msg)
        self.assertLess(len(msg), 4096, msg[:300])
        self.assertIsNone(re.search(r"[\x00-\x09\x0b-\x1f\x7f]", msg), msg)
        for k, v in self.model.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        self.step()  # still usable

    def test_depth_bomb(self):
        with tempfile.TemporaryDirectory() as d:
            n = 100000
            with open(os.path.join(d, "manifest.json"), "w") as f:
                f.write('{"format": ' + "[" * n + "]" * n + "}")
            self.refused(d, "nested deeper than 16 levels")

    def test_size_bomb(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "manifest.json"), "w") as f:
                f.write('{"format": [0' + ",0" * 4999999 + "]}")
            self.refused(d, "more than 4194304 values")

    def test_control_characters(self):
        with tempfile.TemporaryDirectory() as d:
            self.opt.save_checkpoint(d)
            path = os.path.join(d, "manifest.json")
            with open(path) as f:
                m = json.load(f)
            m["param_dtype"] = "fp32\x1b[2J\x1b]0;owned\x07"
            with open(path, "w") as f:
                f.write(seal(m))
            self.refused(d, "'fp32\\x1b[2J\\x1b]0;owned\\x07' is not fp16, bf16 or fp32")


if __name__ == "__main__":
    unittest.main(verbosity=2)
