"""strata.torch: a torch optimizer on strata's ZeRO engine.

    opt = strata.torch.ZeroOptimizer(model, config="zero2-nvme.yaml")
    for x, y in data:
        loss = loss_fn(model(x), y)
        opt.backward(loss)       # loss * loss scale; each gradient goes to the engine as produced
        result = opt.step()      # reduce, clip, overflow check, Adam(W), parameters back in place

The model's parameters are aliased to the engine's parameter memory (stages 0-2), so the update
lands in the model's own tensors without a copy (an FP32 CPU model's are the engine's FP32
master weights themselves at stages 0-1, and 2 without speculation); at stage 3 each module's
parameters are gathered by a forward pre-hook and dropped by a forward post-hook (and gathered
again for the module's backward), with the engine's prefetch. docs/python.md has the whole
contract.
"""
import atexit
import collections.abc
import contextlib
import datetime
import itertools
import json
import math
import os
import time
import types
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _cleanup
from . import _memory
from . import _strata
from . import errors
from .config import load_config

__all__ = ["ZeroOptimizer", "StepResult", "no_decay_param_groups"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_RECOVERY = (
    "The optimizer is now unusable (its state may mix two steps). To recover, on every rank: "
    "create a new ZeroOptimizer for the model and call load_checkpoint(<your last checkpoint "
    "directory>) (examples/train_gpt.py: --resume), or restart the job from that checkpoint."
)


@dataclass
class StepResult:
    """What one step() did (the same on every rank)."""

    applied: bool       # False: skipped for an overflow (inf/NaN gradient on some rank)
    overflow: bool
    grad_norm: float    # global L2 norm of the averaged, unscaled gradients, before clipping
    clip_coef: float    # applied to the gradients (1.0 when not clipped)
    loss_scale: float   # the scale for the next backward()
    # The speculative update (optimizer.overlap, docs/offload.md): chunks of this rank's state
    # updated during the backward, of which committed (no clip, no overflow) or rolled back (the
    # serial update ran instead); exposed_s: seconds from the last gradient handed in (or from
    # step()'s start, if later) to the end of step(), the optimizer time the backward did not hide.
    speculated_chunks: int = 0
    committed_chunks: int = 0
    rolled_back_chunks: int = 0
    exposed_s: float = 0.0
    loss: object = None  # what the closure returned, if step() was given one


def no_decay_param_groups(model, weight_decay=None):
    """torch-style parameter groups: matrices and embeddings (>= 2 dimensions) decay, biases and
    norm weights (< 2 dimensions) do not. Every floating-point parameter is in them, frozen ones
    too (as torch.optim.AdamW(model.parameters()): a frozen parameter is skipped by each step
    while it gets no gradient, and trains once unfrozen; it holds its Adam state in strata's tiers
    all along: leave out the ones that never train to save that memory).
    weight_decay=None keeps the config's optimizer.weight_decay for the first group."""
    decay, no_decay = [], []
    for p in _unique_params(model):
        if p.is_floating_point():
            (decay if p.dim() >= 2 else no_decay).append(p)
    first = {"params": decay}
    if weight_decay is not None:
        first["weight_decay"] = weight_decay
    groups = [first, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class _LazyState(collections.abc.Mapping):
    """ZeroOptimizer.state: AdamW's per-parameter state, read from the engine on access."""

    def __init__(self, opt):
        self._opt = opt

    def _stepped(self):
        opt = self._opt
        if opt._engine is None:
            return []
        return [p for tid, p in enumerate(opt._params) if opt._engine.tensor_step(tid) > 0]

    def __getitem__(self, p):
        opt = self._opt
        tid = opt._ids.get(id(p)) if opt._engine is not None else None
        if tid is None or opt._params[tid] is not p or opt._engine.tensor_step(tid) == 0:
            return {}  # (AdamW's defaultdict(dict) answers {} for a parameter without state)
        opt._check_usable()
        if opt.world > 1 and opt.stage > 0:
            opt._enter_collective("optimizer.state[p]")
        step = torch.tensor(float(opt._engine.tensor_step(tid)), device="cpu")
        return {"step": step, "exp_avg": opt._read(tid, "exp_avg"),
                "exp_avg_sq": opt._read(tid, "exp_avg_sq")}

    def __iter__(self):
        return iter(self._stepped())

    def __len__(self):
        return len(self._stepped())

    def __contains__(self, p):
        return any(q is p for q in self._stepped())


def _materialized(param_groups):
    """torch's param_groups argument (parameters, or dicts of them; any iterables) as a list of
    dicts with a list of parameters each."""
    groups = list(param_groups)
    if not groups or not isinstance(groups[0], dict):
        return [{"params": groups}]
    out = []
    for g in groups:
        g = dict(g)
        ps = g["params"]
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        out.append(g)
    return out


def _unique_params(model):
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


class _RegatherForBackward(torch.autograd.Function):
    """Stage 3: passes a module's outputs through; in backward, first gathers the module's
    parameters again (its own backward reads them)."""

    @staticmethod
    def forward(ctx, opt, ids, *outputs):
        ctx.opt, ctx.ids = opt, ids
        return tuple(o.detach() for o in outputs) if len(outputs) > 1 else outputs[0].detach()

    @staticmethod
    def backward(ctx, *grads):
        ctx.opt._regather(ctx.ids)
        return (None, None) + grads


class ZeroOptimizer(torch.optim.Optimizer):
    """AdamW/Adam (optimizer.type) whose state lives where strata's config puts it.

    Args:
      model: the torch.nn.Module to train (contiguous floating-point parameters of the dtype
        precision.params names, all on the CPU or all on this rank's GPU). Every rank must build
        the same model; rank 0's initial values are broadcast to all. A CUDA model: the engine
        keeps its state on that GPU (runtime.device cuda) where offload.* says gpu, reduces
        through strata's NCCL, and hands gradients and the update over on torch's current stream.
      config: a YAML path, a dict, or None (defaults, with the model's dtype as precision).
      lr, betas, eps, weight_decay: torch.optim.AdamW's, with AdamW's defaults where neither these
        nor the config give a value (lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2);
        given, they win over the config's optimizer.*. The config's optimizer.grad_clip is refused:
        the loop clips (torch.nn.utils.clip_grad_norm_), never the config behind its back.
      overrides: ``{"zero.stage": 3}`` or ``["zero.stage=3"]``, applied after the config.
      param_groups: torch-style groups (``[{"params": [...], "lr": ..., "weight_decay": ...,
        "betas": ..., "eps": ...}]``); default: :func:`no_decay_param_groups` (no weight decay for
        biases and norms). A group without betas / eps takes the config's. Every group's lr,
        weight_decay, betas and eps may change between steps (LR schedulers, OneCycleLR's
        momentum cycle).
      process_group: a torch.distributed group to reduce over (default: the launcher's; see
        docs/python.md, "Launchers").
      stage3_units: stage 3 only — module classes (or a callable module -> bool) each gathered as
        one unit with its whole subtree (FSDP2's fully_shard per block); nn.MultiheadAttention and
        nn.Transformer{Encoder,Decoder}Layer always are. Default: every other module with
        parameters of its own is a unit of those.
      unused_parameters: what a parameter that got no gradient in a step (the loss did not use
        it) does — "warn" (default): skipped, as torch.optim.AdamW skips p.grad None (no update,
        no weight decay, its own step count stays), with a warning once per parameter; on several
        ranks one that some rank used gets zeros from the others (DDP's find_unused_parameters);
        "ignore": the same without the warning; "error": step() raises UsageError.
      keep_grads: p.grad after a backward where it is not a view of the engine's gradient (stage 2,
        a CUDA model, fp32 accumulation of 16-bit gradients): True keeps autograd's gradients as
        p.grad (summed over the micro-batches, the memory torch's p.grad takes); False (default):
        None there. Stages 0-1 on the CPU show a view whatever this says (docs/python.md, "p.grad").

    Collective calls (every rank, same order): the constructor, backward(), step(), state_dict(),
    load_state_dict(), save_checkpoint(), load_checkpoint().
    """

    def __init__(self, model, config=None, *, lr=None, betas=None, eps=None, weight_decay=None,
                 overrides=None, param_groups=None, process_group=None, stage3_units=None,
                 unused_parameters="warn", keep_grads=False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError("strata: ZeroOptimizer(model, ...) needs a torch.nn.Module, not %s"
                            % type(model).__name__)
        if unused_parameters not in ("warn", "ignore", "error"):
            raise errors.InvalidArgumentError(
                "strata: ZeroOptimizer(unused_parameters=%r): 'warn', 'ignore' or 'error'"
                % (unused_parameters,))
        self._unused = unused_parameters
        self._warned_unused = set()  # parameter ids warned about (once each)
        _refuse_ddp(model)
        self._constructing = True
        self._names = {}
        for n, p in model.named_parameters():
            self._names.setdefault(id(p), n)
        if param_groups is None:
            param_groups = no_decay_param_groups(model)
        param_groups = _materialized(param_groups)
        given = [p for g in param_groups for p in g["params"]]
        if not given:
            raise errors.InvalidArgumentError("strata: no parameter to train (the model has none, "
                                              "or param_groups are empty)")
        floats = [p for p in given if isinstance(p, torch.Tensor) and p.is_floating_point()]
        trainable = floats or given  # (the first decides device and precision; checked below)
        defaults = ["model.parameters=%d" % max(1, sum(p.numel() for p in given))]
        # torch.optim.AdamW's keyword arguments win over the config; what neither gives is
        # AdamW's default (strata's own optimizer.lr default, 1e-4, is the CLI trainer's).
        overrides = _with_adamw_arguments(overrides, lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay)
        if not _config_sets(config, overrides, "optimizer", "lr"):
            defaults.append("optimizer.lr=%r" % _ADAMW_LR)
        # A CUDA model: the engine's state on its GPU, the collectives on strata's NCCL. Every
        # address and every tensor on the model's device goes through self._mem (_memory.py).
        self._mem = _memory_factory(trainable[0])
        self._device = self._mem.device
        self._cuda = self._mem.cuda
        if self._cuda and _config_gives(config, overrides, "runtime", "device", "host"):
            raise errors.UnsupportedError(
                "strata: the model is on %s but runtime.device is host: a CUDA model's gradients "
                "and parameters are device memory; use runtime.device: cuda (or auto), or move "
                "the model to the CPU" % self._device)
        if not _config_sets(config, overrides, "runtime", "device"):
            # (a CPU model: said, so that the config's plan is this engine's — at stages 0-1, and
            # 2 without speculation, its FP32 master weights are the parameters themselves:
            # docs/offload.md, "One copy of the weights")
            defaults.append("runtime.device=%s" % ("cuda" if self._cuda else "host"))
        # precision.params / precision.grads the config leaves out follow the model's dtype.
        dt = {v: k for k, v in _DTYPES.items()}.get(trainable[0].dtype)
        if dt is not None:
            for key in ("params", "grads"):
                if not _config_sets(config, overrides, "precision", key):
                    defaults.append("precision.%s=%s" % (key, dt))
        # Gradient buckets of DDP's size (bucket_cap_mb 25), not the engine's 500M elements: a
        # rank keeps up to three to six bucket buffers (a model-sized one otherwise, beside the
        # gradients), and a finer bucket lets optimizer.overlap start earlier. (One rank with
        # optimizer.overlap off on a CPU model keeps none: its hand-ins go straight into the
        # gradients.)
        if not _config_sets(config, overrides, "zero", "reduce_bucket_size"):
            defaults.append("zero.reduce_bucket_size=%d"
                            % (_DDP_BUCKET_BYTES // max(1, trainable[0].element_size())))
        self._config = load_config(config, overrides, defaults=defaults)
        cfg = self._config.summary()
        self._cfg = cfg
        if cfg["grad_clip"] > 0:
            raise errors.InvalidArgumentError(
                "strata: optimizer.grad_clip is %g (%s): in a torch loop the loop clips, so a "
                "config value would clip every step behind its back; call "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), %g) between backward and step "
                "(strata's global norm across ranks; HF Trainer: max_grad_norm) and remove "
                "optimizer.grad_clip (it is for `strata train` and imported DeepSpeed configs)"
                % (cfg["grad_clip"], cfg["source"], cfg["grad_clip"]))
        if keep_grads and cfg["stage"] == 3:
            raise errors.InvalidArgumentError(
                "strata: ZeroOptimizer(keep_grads=True) at zero.stage 3: a parameter's p.data is "
                "empty outside its module's forward and backward, so no p.grad can sit beside it; "
                "read the global norm from clip_grad_norm_() instead, or use stage 2")
        opt_defaults = dict(lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"],
                            weight_decay=cfg["weight_decay"], amsgrad=False, maximize=False,
                            foreach=None, capturable=False)
        super().__init__(param_groups, opt_defaults)

        self._model = model
        self._param_dtype = _DTYPES[cfg["params_dtype"]]
        self._grad_dtype = _DTYPES[cfg["grads_dtype"]]
        self._failed = None
        self._engine = None
        self._backward_s = 0.0
        self._handin_s = 0.0
        self._synced = {}  # group index -> the hyper-parameters last given to the engine
        self._in_backward = False  # inside opt.backward(): the loss is scaled
        # Every parameter is checked before anything else happens (no process group, no engine).
        # The engine's tensors (tid) are the parameters in the model's order, whatever their
        # groups: the backward hands gradients in about the reverse of it, so each gradient bucket
        # completes while the backward goes on (in group order, the no-decay group's biases and
        # norms of every layer share the top bucket, which several ranks must reduce first: it
        # would complete only at the last hand-in, holding every bucket until then).
        # self._tid_of[k]: the tid of torch's parameter index k (group order, state_dict's).
        in_groups = [(gi, p) for gi, group in enumerate(self.param_groups) for p in group["params"]]
        self._ids = {}
        for _, p in in_groups:
            self._check_param(p)  # (a parameter given twice: refused here)
            self._ids[id(p)] = None
        where = {id(p): i for i, p in enumerate(_unique_params(model))}
        order = sorted(range(len(in_groups)),
                       key=lambda k: (where.get(id(in_groups[k][1]), len(where)), k))
        self._params = [in_groups[k][1] for k in order]
        self._group_of = [in_groups[k][0] for k in order]
        self._shapes = [p.shape for p in self._params]
        self._ids = {id(p): tid for tid, p in enumerate(self._params)}
        self._tid_of = [0] * len(order)
        for tid, k in enumerate(order):
            self._tid_of[k] = tid
        _cleanup.install_signal_cleanup()  # swap removed on SIGTERM/SIGINT/SIGHUP (chained)
        self._engine = self._make_engine(process_group)
        self.rank = self._engine.rank
        self.world = self._engine.world
        self.stage = self._engine.stage
        self._uid = next(_OPTIMIZERS)  # the same on every rank: they build in the same order
        self._phase_no = 0  # collective phases announced (_announce)
        self._phase_open = False  # a step's collectives began (its first gather or hand-in)
        # The default group's store: keyed by this optimizer's number, the ranks of one group only.
        self._store = (_default_store() if self.world > 1 and "c10d" in self.backend
                       and dist.is_initialized() and dist.get_world_size() == self.world else None)

        # Register them (the groups, then the parameters in tid order: the same on every rank).
        # The initial values stay where the model is (device memory of a CUDA model: the binding
        # copies them to the host through the CUDA runtime, after torch's queued work).
        self._mem.synchronize()
        for group in self.param_groups[1:]:
            self._engine.add_param_group(float(group["lr"]), float(group["weight_decay"]))
        inits = []  # borrowed by the engine until finalize(): no second copy of the model
        for tid, p in enumerate(self._params):
            inits.append(p.detach().to(torch.float32).contiguous())
            got = self._engine.add_parameter(self._name(p), self._mem.address(inits[-1]),
                                             inits[-1].numel(), self._group_of[tid], borrow=True)
            assert got == tid, (got, tid)
        self._sync_groups()
        self._engine.finalize()
        self._params_are_master = self._engine.params_are_master()
        del inits
        self._arrived = [False] * len(self._params)  # in the current micro-batch
        # zero_grad(set_to_none=False): torch keeps a zero p.grad for every parameter that had a
        # gradient, so AdamW steps one the next loss does not use (on zeros): strata hands it zeros.
        self._had_grad = [False] * len(self._params)
        self._zeros_kept = False
        self._n_arrived = 0
        self._micro = 0  # micro-batches of this step before the current one
        self._clip_norm = None  # this step's global norm, once clip_grad_norm_ asked for it
        self._gathered_all = False  # inside full_parameters()
        self._warned_skipped_export = False
        # The model's parameters strata does not train (frozen at construction): a later
        # requires_grad_(True) is refused, not silently ignored.
        self._frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in self._ids]
        self._trained_names = {n: p for n, p in model.named_parameters() if id(p) in self._ids}
        for p in self._params:
            _OWNER[id(p)] = (weakref.ref(p), weakref.ref(self))
        _LIVE.add(self)  # closed at interpreter exit if the loop did not (_close_at_exit)
        self._constructing = False

        # Gradient hooks: on the AccumulateGrad node, created now (while every parameter still has
        # its full shape: autograd checks gradients against the shape it records here), for frozen
        # parameters too (requires_grad on for the moment it takes): held here, the same node
        # takes their gradients once they are unfrozen.
        self._grad_accs, self._hook_handles = [], []
        with torch.enable_grad():
            for tid, p in enumerate(self._params):
                frozen = not p.requires_grad
                p.requires_grad_(True)
                try:
                    acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    self._hook_handles.append(p.register_hook(self._grad_pre_hook(tid)))
                finally:
                    p.requires_grad_(not frozen)
                self._hook_handles.append(acc.register_hook(self._grad_hook(tid)))
                self._grad_accs.append(acc)

        self._install_grad_views(keep_grads)
        if self.stage < 3:
            for tid, p in enumerate(self._params):
                p.data = self._engine_tensor(tid)
            self._mem.after_engine_wrote()
            # torch's version counters: a write into a parameter (load_state_dict, nn.init, an
            # in-place op under no_grad) is seen at the next step's first gradient (_begin_step).
            self._versions = [p._version for p in self._params]
            self._buffers = [p.data_ptr() for p in self._params]
        else:
            self._empty = self._mem.empty((0,), self._param_dtype)
            for p in self._params:
                p.data = self._empty
            self._held = set()  # gathered again for a backward whose gradient has not arrived
            self._install_stage3_hooks(model, stage3_units)
            self._install_state_dict_hooks(model)

    @property
    def state(self):
        """torch's optimizer.state: parameter -> {"step", "exp_avg", "exp_avg_sq"} as AdamW's,
        read from the engine when asked (CPU tensors; a parameter never stepped: {}). With
        several ranks at stages 1-3 each read gathers the parameter's shards: collective, every
        rank reads the same parameters in the same order (opt.state_dict() reads them all)."""
        return _LazyState(self)

    @state.setter
    def state(self, value):  # torch.optim.Optimizer.__init__ assigns its own dict: not used
        pass

    def add_param_group(self, param_group):
        """Parameter groups are fixed when the optimizer is built (strata partitions the parameters
        across ranks then): pass every group to ZeroOptimizer(param_groups=...)."""
        if getattr(self, "_constructing", True):
            return super().add_param_group(param_group)
        raise errors.UnsupportedError(
            "strata: add_param_group() after construction: strata partitions the parameters across "
            "ranks when the optimizer is built, so its groups are fixed then; pass every group to "
            "ZeroOptimizer(model, param_groups=[...]) (a group may start with lr=0 and be raised "
            "later by a scheduler or by setting param_groups[i]['lr'])")

    # ---- construction helpers ----
    def _name(self, p):
        return self._names.get(id(p), "<parameter %d>" % self._ids.get(id(p), len(self._ids)))

    def _check_param(self, p):
        name = self._name(p)
        if id(p) in self._ids:
            raise errors.InvalidArgumentError("strata: parameter '%s' appears twice in param_groups" % name)
        if p.layout != torch.strided:
            raise errors.InvalidArgumentError("strata: parameter '%s' is %s; strata holds dense tensors only"
                                              % (name, p.layout))
        if not p.is_floating_point():
            raise errors.ParameterTypeError(
                "strata: parameter '%s' is %s, not floating point: strata trains float parameters "
                "(precision.params: fp32 | bf16 | fp16); leave it out of param_groups" % (name, p.dtype))
        if self._mem.device_of(p) != self._device:
            raise errors.UnsupportedError(
                "strata: parameter '%s' is on %s, the first one on %s: strata trains a model on one "
                "device (the CPU, or this rank's GPU)" % (name, self._mem.device_of(p), self._device))
        if self._device.type not in ("cpu", "cuda") or (self._cuda and not _strata.with_cuda):
            raise errors.UnsupportedError(
                "strata: parameter '%s' is on %s; this strata supports the CPU%s" % (
                    name, self._device,
                    " and CUDA" if _strata.with_cuda else " only (built without CUDA)"))
        if not p.is_contiguous():
            raise errors.InvalidArgumentError(
                "strata: parameter '%s' is not contiguous (shape %s, strides %s, e.g. a transposed "
                "view): strata keeps each parameter as one flat run of its buffer; make it contiguous "
                "first (p.data = p.data.contiguous())" % (name, tuple(p.shape), tuple(p.stride())))
        if p.dtype != self._param_dtype:
            raise errors.ParameterTypeError(
                "strata: parameter '%s' is %s but the config (%s) has precision.params: %s; convert "
                "the model (model.to(%s)) or set precision.params to match"
                % (name, p.dtype, self._cfg["source"], self._cfg["params_dtype"], self._param_dtype))

    def _make_engine(self, process_group):
        choice = self._cfg["communicator"]
        if self._cuda:
            return self._make_cuda_engine(process_group, choice)
        if process_group is not None:
            return _strata.Engine(self._config, "c10d", process_group)
        if choice == "nccl":
            raise errors.UnsupportedError(
                "strata: runtime.communicator: nccl needs the model on a GPU (this one is on the "
                "CPU); use auto, or mpi under mpirun")
        if choice == "mpi" or (choice == "auto" and _strata.launched_by_mpi()):
            if not _strata.launched_by_mpi() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise errors.UsageError(
                    "strata: runtime.communicator: mpi, but this process was started by torchrun "
                    "(WORLD_SIZE=%s), not mpirun: each rank would train alone; use "
                    "runtime.communicator: auto" % os.environ["WORLD_SIZE"])
            if not _strata.with_mpi:
                raise errors.UnsupportedError("strata: launched by mpirun but this strata was built "
                                              "without MPI (Debian: libopenmpi-dev; rebuild)")
            return _strata.Engine(self._config, "mpi")
        if choice == "inprocess":
            return _strata.Engine(self._config, "single")
        group = _launcher_group(self._cfg["collective_timeout_s"])
        if group is None:
            return _strata.Engine(self._config, "single")
        return _strata.Engine(self._config, "c10d", group)

    def _make_cuda_engine(self, process_group, choice):
        """strata's NCCL on the model's GPU; its id goes over `process_group`, else the launcher's
        gloo group (torchrun), else MPI (mpirun), else a one-rank world."""
        if choice not in ("auto", "nccl"):
            raise errors.UnsupportedError(
                "strata: the model is on %s and runtime.communicator is %s: a CUDA model reduces on "
                "its GPU through NCCL; use runtime.communicator: auto or nccl" % (self._device, choice))
        group = process_group
        if group is None and not _strata.launched_by_mpi():
            group = _launcher_group(self._cfg["collective_timeout_s"])
        index = (self._device.index if self._device.index is not None
                 else torch.cuda.current_device())
        return _strata.Engine(self._config, "nccl", group, index)

    def _stream(self):
        """torch's current stream on the model's GPU (its raw handle), None for a CPU model."""
        return self._mem.stream()

    def _engine_tensor(self, tid):
        shape = self._shapes[tid]
        if self._params[tid].numel() == 0:
            return self._mem.empty(shape, self._param_dtype)
        buf = self._engine.param_buffer(tid)  # keeps the engine alive as long as the tensor
        return self._mem.alias(buf, self._param_dtype, shape)

    # ---- gradients ----
    def _grad_hook(self, tid):
        def hook(*_):
            p = self._params[tid]
            g = p.grad
            if g is None:
                return
            p.grad = None
            self._hand_in(tid, g)
            if self.stage == 3:
                self._held.discard(tid)
                p.data = self._empty
            else:
                self._show_grad(tid, g)
        return hook

    def _install_grad_views(self, keep_grads):
        """p.grad after a backward (docs/python.md, "p.grad"): stages 0-1 with gradients held in the
        parameters' dtype — a view of the engine's gradient of this step (no memory); otherwise,
        with keep_grads, a copy accumulated as torch's p.grad (the memory torch's would take);
        else None. Shown from a parameter's hand-in until step() or zero_grad()."""
        accum = _DTYPES[self._cfg["grad_accum_dtype"]]
        self._grad_views = None
        # (A CUDA model's engine copies on its own stream, unordered with torch's: no view there.)
        if self.stage < 2 and accum == self._param_dtype and not self._cuda:
            self._grad_views = [self._mem.alias(self._engine.grad_buffer(tid), accum, shape)
                                if self._params[tid].numel() else None
                                for tid, shape in enumerate(self._shapes)]
        self._show = keep_grads or self._grad_views is not None
        self._shown = [None] * len(self._params)  # the p.grad each parameter shows now

    def _show_grad(self, tid, g):
        """After tid's hand-in: p.grad shows the step's gradient so far (_install_grad_views)."""
        if not self._show:
            return
        if self._grad_views is not None:
            shown = self._grad_views[tid] if g.numel() else g
        elif self._shown[tid] is None or self._micro == 0:
            shown = g  # autograd's tensor, no longer the engine's business (copied or queued)
        elif self._cuda:  # (the engine's copy of the earlier one may still read it, on its stream)
            shown = self._shown[tid] + g  # a later micro-batch: summed as torch's p.grad
        else:
            shown = self._shown[tid].add_(g)
        self._params[tid].grad = shown
        self._shown[tid] = shown

    def _grad_pre_hook(self, tid):
        """Before autograd accumulates into p.grad: the gradient shown (_show_grad) is taken away
        first, so that autograd hands over a fresh one (an accumulation into the engine's own
        memory would add a micro-batch twice). A p.grad the loop set itself stays."""
        def hook(_):
            p = self._params[tid]
            if self._shown[tid] is not None and p.grad is self._shown[tid]:
                p.grad = None
        return hook

    def _hide_grads(self):
        """step() consumed the gradients (or zero_grad dropped them): p.grad None again."""
        for tid, shown in enumerate(self._shown):
            if shown is not None:
                p = self._params[tid]
                if p.grad is shown:
                    p.grad = None
                self._shown[tid] = None

    def _hand_in(self, tid, g):
        self._check_usable()
        if g.layout != torch.strided:
            raise errors.InvalidArgumentError("strata: the gradient of '%s' is %s; strata takes dense "
                                              "gradients" % (self._name(self._params[tid]), g.layout))
        if g.dtype != self._grad_dtype:
            g = g.to(self._grad_dtype)
        g = g.contiguous()
        if self._n_arrived == 0 and self._micro == 0:
            self._begin_step()
        if self._arrived[tid]:
            self._next_micro_batch(tid)
        t0 = time.perf_counter()
        if self._cuda:  # the engine's copy waits for the stream that wrote g, on the GPU: the
            # autograd thread does not wait; g stays allocated until that copy ran
            self._call(self._engine.set_gradient_device, tid, self._mem.address(g), self._stream())
            self._mem.keep_until(g, self._engine.gradient_stream)
        else:
            self._call(self._engine.set_gradient, tid, self._mem.host_address(g))
        self._handin_s += time.perf_counter() - t0
        self._arrived[tid] = True
        self._had_grad[tid] = True
        self._n_arrived += 1

    def _begin_step(self):
        """At the step's first gradient, before the engine sees it (nothing of this step handed in
        yet): what the loop changed since the last step reaches the engine now, so that an update
        during the backward (optimizer.overlap) uses it — a scheduler's lr, and parameters written
        into the model. A loss scale in force needs opt.backward (else the gradients would be
        loss-scale times too small, silently)."""
        scale = self._engine.loss_scale()
        if scale != 1.0 and not self._in_backward:
            raise errors.UsageError(
                "strata: a gradient arrived from a backward that did not go through "
                "opt.backward(loss), while the loss scale is %g (fp16 gradients, or "
                "precision.loss_scale.enabled): strata divides every gradient by the scale, "
                "so these would be %g times too small. Call opt.backward(loss) (it multiplies "
                "the loss by opt.loss_scale), or train without loss scaling (bf16 / fp32). "
                "Nothing of this step was handed in; opt.zero_grad() and go on" % (scale, scale))
        self._open_step_phase("a step's backward")
        self._sync_groups()
        if self.stage < 3:
            self._reseed_written()

    def _written_params(self):
        """The parameters (stages 0-2) written since the engine last saw them: torch's version
        counter moved. Writes through p.data bypass it (torch's own escape hatch; docs/python.md).
        """
        return [tid for tid, p in enumerate(self._params) if p._version != self._versions[tid]]

    def _reseed_written(self):
        """Parameters written into the model between steps become the FP32 master (this rank's
        part; no collective at stages 0-2), as torch.optim.AdamW steps from what p holds; the
        moments and step counts are kept, as AdamW keeps its state. Where the parameters are the
        master (engine.params_are_master(), docs/offload.md) the write was the master's already."""
        written = self._written_params()
        copy = written and not self._params_are_master
        if copy:
            self._mem.synchronize()  # the binding copies device memory on the legacy stream
        for tid in written:
            p = self._params[tid]
            if self._moved(tid):
                raise self._moved_error()
            v = p.detach().to(torch.float32).contiguous() if copy else None  # on the model's device
            if copy and v.numel():
                self._engine.write_state(tid, "master", self._mem.address(v))
            self._versions[tid] = p._version
        if copy:
            self._mem.after_engine_wrote()

    def _engine_wrote_params(self):
        """The engine wrote the parameters itself (a load): what the model holds is its own."""
        if self.stage < 3:
            self._versions = [p._version for p in self._params]

    def _moved_error(self):
        return errors.UsageError(
            "strata: the model's parameters were moved or converted after ZeroOptimizer was built "
            "(model.to(), .double()/.half(), accelerate's prepare(model) onto a device): they are "
            "no longer strata's memory, so its gradient hooks and in-place updates cannot reach "
            "them. Move or convert the model first, then build the optimizer")

    def _moved(self, tid):
        """Stages 0-2: parameter tid is no longer a view of the engine's memory."""
        p = self._params[tid]
        return p.numel() > 0 and (p.data_ptr() != self._buffers[tid] or p.dtype != self._param_dtype
                                  or self._mem.device_of(p) != self._device)

    def _check_not_moved(self):
        if self.stage < 3 and any(self._moved(tid) for tid in range(len(self._params))):
            raise self._moved_error()

    def _next_micro_batch(self, tid):
        """A gradient arrives again: the next micro-batch, once the current one handed in every
        gradient (else UsageError; nothing changes)."""
        self._skip_unused(only_frozen=True)
        if self._n_arrived < len(self._params) and self._unused != "error":
            self._skip_unused()  # the missing ones had no gradient in the micro-batch that ended
        if self._n_arrived < len(self._params):
            missing = [self._name(p) for p, a in zip(self._params, self._arrived) if not a]
            raise errors.UsageError(
                "strata: the gradient of '%s' arrived again (micro-batch %d) before micro-batch %d "
                "handed in every gradient (%s%s missing): each backward must produce a gradient for "
                "every parameter strata trains" % (
                    self._name(self._params[tid]), self._micro + 2, self._micro + 1,
                    ", ".join("'%s'" % n for n in missing[:4]),
                    " and %d more" % (len(missing) - 4) if len(missing) > 4 else ""))
        if self._clip_norm is not None:
            raise errors.UsageError("strata: a backward after clip_grad_norm_() and before step()")
        self._arrived = [False] * len(self._params)
        self._n_arrived = 0
        self._micro += 1

    def _skip_unused(self, only_frozen=False):
        """The parameters whose gradient did not arrive in this micro-batch (the loss did not use
        them, or they are frozen): handed to the engine as skipped — zeros from this rank; the
        update skips the ones no rank used, as torch.optim.AdamW skips p.grad None. Warned once
        per parameter, except frozen ones (requires_grad False: expected to get none).
        only_frozen: the frozen ones only (whatever unused_parameters says)."""
        for tid, a in enumerate(self._arrived):
            frozen = not self._params[tid].requires_grad
            if a or (only_frozen and not frozen):
                continue
            if self._zeros_kept and self._had_grad[tid]:  # torch's p.grad: zeros, not None
                self._hand_in(tid, self._mem.zeros(self._shapes[tid], self._grad_dtype))
                continue
            self._call(self._engine.skip_gradient, tid)
            self._arrived[tid] = True
            self._n_arrived += 1
            if self._unused == "warn" and not frozen and tid not in self._warned_unused:
                self._warned_unused.add(tid)
                warnings.warn(
                    "strata: parameter '%s' got no gradient in this step (the loss did not use "
                    "it): it is skipped by the update, as torch.optim.AdamW skips a grad of None "
                    "(on several ranks: where another rank used it, this rank adds zeros, as DDP's "
                    "find_unused_parameters). Warned once per parameter; "
                    "ZeroOptimizer(unused_parameters='ignore') silences it."
                    % self._name(self._params[tid]), UserWarning, stacklevel=4)

    @property
    def loss_scale(self):
        """The factor backward() multiplies the loss by (1.0 with fp32 gradients)."""
        return self._engine.loss_scale()

    def backward(self, loss, retain_graph=False):
        """loss * loss_scale, then backward; the gradient hooks hand every parameter's gradient to
        the engine as autograd produces it (at stages 2-3 a full bucket starts its reduce-scatter
        while the rest of the backward runs). Gradient accumulation: call it once per micro-batch
        before step(); the step's gradient is the sum of the micro-batches' gradients, as torch's
        p.grad accumulates (scale each micro-batch's loss by 1/K yourself, as in a torch loop),
        held in precision.grad_accum (16-bit gradients: their own dtype, as p.grad, or fp32).
        Each backward must produce a gradient for every trained parameter."""
        self._check_usable()
        self._check_requires_grad()
        scale = self._engine.loss_scale()
        t0 = time.perf_counter()
        self._in_backward = True
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        finally:
            self._in_backward = False
        self._backward_s += time.perf_counter() - t0

    def zero_grad(self, set_to_none=True):
        """Gradients live in the engine and are consumed by step(): between steps nothing to
        zero. Between backward() and step() — or after step() refused a missing gradient — it
        drops this step's gradients, as torch's does (every rank alike: each rank drops its own;
        the reductions already started finish first). set_to_none=False keeps torch's zeros: from
        then on a parameter that had a gradient and gets none from a later loss is stepped on a
        zero gradient (moments decay, weight decay applies), as torch.optim.AdamW steps its zero
        p.grad; with True (the default) it is skipped, as AdamW skips p.grad None."""
        self._check_usable()
        self._zeros_kept = not set_to_none
        self._drop_step_gradients()
        for p in self._params:
            p.grad = None

    def _drop_step_gradients(self):
        """The gradients handed in since the last step() are dropped (every rank alike)."""
        self._hide_grads()
        if not (self._n_arrived or self._micro):
            return
        self._call(self._engine.discard_gradients)
        self._arrived = [False] * len(self._params)
        self._n_arrived = 0
        self._micro = 0
        self._clip_norm = None
        self._phase_open = False
        if self.stage == 3:
            for tid in self._held:
                self._params[tid].data = self._empty
            self._held.clear()

    # ---- the step ----
    def _sync_groups(self):
        """Every group's lr, weight_decay, betas and eps as the loop (or a scheduler) left them."""
        for gi, group in enumerate(self.param_groups):
            betas = tuple(group["betas"])
            if len(betas) != 2:
                raise errors.InvalidArgumentError("strata: param_groups[%d]['betas'] = %s: two values "
                                                  "(beta1, beta2)" % (gi, group["betas"]))
            for key in ("maximize", "amsgrad"):
                if group.get(key):
                    raise errors.UnsupportedError(
                        "strata: param_groups[%d]['%s'] = True: strata's Adam(W) minimizes, "
                        "without AMSGrad; it would be ignored, so it is refused (set it False)"
                        % (gi, key))
            hp = (float(group["lr"]), float(group["weight_decay"]), float(betas[0]),
                  float(betas[1]), float(group["eps"]))
            if self._synced.get(gi) == hp:
                continue  # a setter joins the speculative update: a group unchanged is not set
            self._engine.set_lr(hp[0], gi)  # (a value set again unchanged discards nothing)
            self._engine.set_weight_decay(hp[1], gi)
            self._engine.set_betas(hp[2], hp[3], gi)
            self._engine.set_eps(hp[4], gi)
            self._synced[gi] = hp

    @torch.no_grad()
    def step(self, closure=None):
        """Reduces the gradients across ranks, computes the global norm, clips (optimizer.grad_clip),
        agrees on overflow (all ranks skip together), runs Adam(W) on this rank's partition and
        brings the parameters back into the model's tensors. Returns a StepResult."""
        self._check_usable()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_requires_grad()
        if self._n_arrived == 0:
            self._check_not_moved()
            raise errors.UsageError(
                "strata: step() before backward(): no gradient arrived in this step; call "
                "opt.backward(loss) (or loss.backward()) first")
        if self.stage < 3:  # written since the first gradient (between micro-batches, or now):
            self._reseed_written()  # an update speculated from the old ones is discarded
        self._skip_unused(only_frozen=True)
        if self._n_arrived < len(self._params) and self._unused != "error":
            self._skip_unused()
        if self._n_arrived < len(self._params):
            missing = [self._name(p) for p, a in zip(self._params, self._arrived) if not a]
            more = " and %d more" % (len(missing) - 8) if len(missing) > 8 else ""
            raise errors.UsageError(
                "strata: step(): the gradients of %s%s never arrived%s (%d of %d did). A parameter the "
                "forward did not use gets no gradient: leave it out of param_groups (build the "
                "optimizer with it frozen), or let the step skip it (unused_parameters='warn'). "
                "opt.zero_grad() drops this step's gradients and the "
                "loop can go on. (On ranks that did step() the step will time out.)"
                % (", ".join("'%s'" % n for n in missing[:8]), more,
                   " in micro-batch %d" % (self._micro + 1) if self._micro else "",
                   self._n_arrived, len(self._params)))
        self._sync_groups()
        r = self._call(self._engine.step, self._stream())  # waits for torch's queued reads
        self._hide_grads()
        if self.stage < 3:
            self._mem.after_engine_wrote()
        if self.stage == 3:
            for tid in self._held:
                self._params[tid].data = self._empty
            self._held.clear()
        self._arrived = [False] * len(self._params)
        self._n_arrived = 0
        self._micro = 0  # micro-batches of this step before the current one
        self._clip_norm = None
        self._phase_open = False
        return StepResult(loss=loss, **r)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ over every parameter of this optimizer, between backward
        and step (collective: every rank calls it): reduces this step's gradients, returns their
        global L2 norm (of the averaged, unscaled gradients, as torch computes it on the averaged
        p.grad) as a 0-dim float32 tensor, and step() scales them by min(1, max_norm / (norm +
        1e-6)), torch's coefficient. torch.nn.utils.clip_grad_norm_(model.parameters(), ...)
        lands here once strata.torch is imported. Only the L2 norm (norm_type 2) is supported."""
        self._check_usable()
        norm_type = float(norm_type)
        if norm_type != 2.0:
            raise errors.UnsupportedError(
                "strata: clip_grad_norm_(norm_type=%s): strata computes the global L2 norm across "
                "ranks; use norm_type=2" % norm_type)
        if self._n_arrived:
            self._skip_unused(only_frozen=True)
        if self._n_arrived == 0 or (self._n_arrived < len(self._params) and self._unused == "error"):
            self._check_not_moved()
            raise errors.UsageError(
                "strata: clip_grad_norm_() before the backward handed in every gradient (%d of %d): "
                "call it after backward() and before step()" % (self._n_arrived, len(self._params)))
        self._skip_unused()  # torch's clip_grad_norm_ leaves out p.grad None
        max_norm = float(max_norm)
        if math.isnan(max_norm) or max_norm < 0:
            raise errors.InvalidArgumentError("strata: clip_grad_norm_(max_norm=%s): must be >= 0"
                                              % max_norm)
        norm = self._call(self._engine.clip_grad_norm, max_norm)
        self._clip_norm = norm
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. (strata: this step will be "
                               "skipped on every rank)")
        return self._mem.scalar(norm)

    def _enter_collective(self, what):
        """Every rank enters the collective method `what` before its collectives start (see
        _announce)."""
        self._announce("%s()" % what)

    def _open_step_phase(self, what):
        """The step's first collective work on this rank (a stage-3 forward's gather, or the first
        gradient handed in): announced once per step (step() closes it)."""
        if not self._phase_open:
            self._announce(what)
            self._phase_open = True

    def _announce(self, what):
        """Each rank's collective work is a sequence of phases — a collective method, or a step's
        collectives — the same on every rank. Under torchrun each phase is announced in the
        process group's store (not a collective) and checked against every other rank's phase of
        the same number before its collectives start. A rank that does something else (calls
        state_dict() alone, as HF Trainer saves the optimizer on the main process only; evaluates
        a stage-3 model under `if rank == 0`) raises UsageError naming both calls as soon as the
        other rank's announcement is there, instead of pairing its gathers with the other's
        collectives (gloo aborts the processes) or waiting out a collective timeout; the other
        rank raises too. A rank that announces nothing: UsageError after
        runtime.collective_timeout_s."""
        if self._store is None:
            return
        self._phase_no += 1
        n, key = self._phase_no, "strata/optimizer%d/phase%%d/rank%%d" % self._uid
        # The label as a number (store.add: atomic and never blocks; a Store.wait with a timeout
        # leaves its late answer in the socket, desynchronizing the next call, in torch 1.13).
        self._store.add(key % (n, self.rank), _PHASES.index(what) + 1)
        if n > 2:
            # This rank saw every rank's n - 1, and each announced n - 1 only after reading every
            # rank's n - 2: nobody reads this rank's n - 2 any more (n - 1 may still be read).
            try:
                self._store.delete_key(key % (n - 2, self.rank))
            except (RuntimeError, AttributeError):
                pass
        timeout = float(self._cfg["collective_timeout_s"])
        deadline = time.monotonic() + timeout
        waiting = [r for r in range(self.world) if r != self.rank]
        while waiting:
            for r in list(waiting):
                try:
                    code = self._store.add(key % (n, r), 0)  # 0: not announced yet
                except RuntimeError as e:
                    raise errors.CommError(
                        "strata: %s: the process group's store failed while rank %d waited for "
                        "rank %d's next collective call (%s): did rank %d exit?"
                        % (what, self.rank, r, e, r)) from None
                if code == 0:
                    continue
                theirs = _PHASES[code - 1] if 0 < code <= len(_PHASES) else "call #%d" % code
                if theirs != what:  # (the phase stays used on both: their numbers stay equal)
                    raise errors.UsageError(
                        "strata: rank %d is in %s where rank %d is in %s: the ranks must make the "
                        "same collective calls in the same order (state_dict, load_state_dict, "
                        "save/load_checkpoint, full_parameters, wait_checkpoint and each step's "
                        "forward / backward / step). HF Trainer saves the optimizer on the main "
                        "process only: save with opt.save_checkpoint(dir) from a callback every "
                        "rank runs; evaluate a stage-3 model on every rank, or inside "
                        "opt.full_parameters() entered by every rank (docs/python.md)"
                        % (self.rank, what, r, theirs)) from None
                waiting.remove(r)
            if waiting:
                time.sleep(0.002)
            if waiting and time.monotonic() > deadline and not what.endswith("()"):
                # A step's collectives: the other rank is dead or stalled, as a collective that
                # timed out would say; the job cannot go on without it.
                self._failed = "rank(s) %s never began %s" % (", ".join(map(str, waiting)), what)
                raise errors.TimeoutError(
                    "strata: %s: rank %d waited runtime.collective_timeout_s = %g s for rank(s) %s "
                    "to begin it (dead, stalled, or in another call).\n%s"
                    % (what, self.rank, timeout, ", ".join(map(str, waiting)), _RECOVERY))
            if waiting and time.monotonic() > deadline:
                raise errors.UsageError(
                    "strata: %s is collective (each rank holds a shard): rank %d entered it and "
                    "rank(s) %s did not within runtime.collective_timeout_s = %g s. Call it on "
                    "every rank, in the same order as the other collective calls; HF Trainer saves "
                    "the optimizer on the main process only: save with opt.save_checkpoint(dir) "
                    "from a callback every rank runs (docs/python.md)"
                    % (what, self.rank, ", ".join(map(str, waiting)), timeout))

    def _check_not_replaced(self):
        """A Parameter object the model no longer holds (model.load_state_dict(sd, assign=True),
        accelerate / HF meta-device loading, setattr) has strata's hooks and aliasing; the new
        one has neither: refused by name (review R7) instead of a baffling 'step() before
        backward()'."""
        for n, p in self._model.named_parameters():
            mine = self._trained_names.get(n)
            if mine is not None and p is not mine:
                raise errors.UsageError(
                    "strata: the model's parameter '%s' was replaced by another Parameter object "
                    "after ZeroOptimizer was built (model.load_state_dict(..., assign=True), a "
                    "meta-device load, or an assignment): strata's gradient hooks and memory "
                    "stay with the old one. Load into the existing parameters (assign=False, or "
                    "p.data.copy_(...)), or load first and build the optimizer after" % n)

    def _check_requires_grad(self):
        """Freezing and unfreezing a parameter the optimizer holds is AdamW's (a frozen one is
        skipped by the step); one the optimizer does not hold that becomes trainable is refused:
        strata's partition is fixed when the optimizer is built, it would never train."""
        self._check_not_replaced()
        for name, p in self._frozen:
            if p.requires_grad:
                raise errors.UsageError(
                    "strata: parameter '%s' is not in the optimizer's param_groups (it was left out "
                    "when ZeroOptimizer was built) and now requires grad: strata would never train "
                    "it. Build the optimizer with it in param_groups (frozen parameters may be: "
                    "they train once unfrozen), or freeze it again" % name)

    # ---- failures ----
    def _call(self, fn, *args):
        """Calls an engine method whose failure (other than bad input) leaves the engine failed
        (engine.hpp: set_gradient, step, and the stage-3 gathers, which are collectives of the
        step): marks this optimizer failed and adds how to recover to the message. Checkpoints and
        state access verify before they change anything and are called directly."""
        try:
            return fn(*args)
        except errors.StrataError as e:
            if e.code != "invalid argument" and not isinstance(e, errors.UsageError):
                self._failed = str(e).splitlines()[0]
                e.args = ("%s\n%s" % (e, _RECOVERY),) + e.args[1:]
            raise

    def _check_usable(self):
        if self._failed is not None:
            raise errors.EngineFailedError("strata: refused: an earlier step failed (%s).\n%s"
                                           % (self._failed, _RECOVERY))

    # ---- stage 3 ----
    def _install_stage3_hooks(self, model, units):
        """Stage 3: a forward pre-hook gathers a unit's parameters, a post-hook drops them. A unit is
        a module whose forward reads every parameter of its subtree (nested units excepted): by
        default each module with parameters of its own, except the torch modules whose forward
        reads their children's parameters directly (nn.MultiheadAttention reads out_proj's;
        nn.Transformer{Encoder,Decoder}Layer's fast path reads all of its children's), which are
        one unit with their whole subtree. `units` (classes, or a callable module -> bool) names
        more whole-subtree units, as FSDP2's fully_shard per block."""
        whole = _whole_unit_test(units)
        self._stage3_handles = []

        def own(m, subtree):
            ps = m.parameters(recurse=subtree)
            return tuple(dict.fromkeys(self._ids[id(p)] for p in ps if id(p) in self._ids))

        def visit(m):
            if whole(m):
                self._hook_unit(m, own(m, True))
                return
            self._hook_unit(m, own(m, False))
            for c in m.children():
                visit(c)
        visit(model)

    def _hook_unit(self, module, ids):
        if ids:
            self._stage3_handles.append(module.register_forward_pre_hook(self._pre_forward(ids)))
            self._stage3_handles.append(module.register_forward_hook(self._post_forward(ids)))

    def _fetch(self, ids):
        """Gathers `ids` and gives each parameter a private copy of its full tensor (the engine's
        gathered buffer is released at once; autograd may keep the copy for the backward)."""
        self._call(self._engine.gather, list(ids))
        full = [self._mem.empty(self._shapes[tid], self._param_dtype) for tid in ids]
        some = [(tid, t) for tid, t in zip(ids, full) if t.numel()]
        if some:  # one wait for the module's copies, not one per tensor
            with self._mem.outputs([t for _, t in some]) as addresses:
                self._engine.copy_params([tid for tid, _ in some], addresses, self._stream())
        for tid, t in zip(ids, full):
            self._params[tid].data = t
        self._call(self._engine.release, list(ids))

    def _pre_forward(self, ids):
        def hook(module, inputs):
            self._check_usable()
            if not self._gathered_all:
                self._open_step_phase("a forward with gradients" if torch.is_grad_enabled()
                                      else "a forward under no_grad (evaluation)")
            self._fetch(ids)
        return hook

    def _post_forward(self, ids):
        def hook(module, inputs, output):
            for tid in ids:  # not those a backward is about to read (checkpoint's recompute)
                if tid not in self._held:
                    self._params[tid].data = self._empty
            if not torch.is_grad_enabled():
                return output
            if isinstance(output, torch.Tensor):
                return _RegatherForBackward.apply(self, ids, output) if output.requires_grad else output
            if isinstance(output, tuple) and output and all(isinstance(o, torch.Tensor) for o in output):
                if any(o.requires_grad for o in output):
                    return tuple(_RegatherForBackward.apply(self, ids, *output))
            return output
        return hook

    def _regather(self, ids):
        """A module's backward is about to run: its parameters are gathered again. (A parameter's
        gradient arrives after every module that uses it ran its backward: autograd sums the uses
        first.)"""
        self._held.update(ids)  # until their gradients arrive (a recompute must not drop them)
        todo = tuple(t for t in ids if tuple(self._params[t].data.shape) != tuple(self._shapes[t]))
        if todo:
            self._fetch(todo)

    def _install_state_dict_hooks(self, model):
        """Stage 3: model.state_dict() holds full tensors — inside full_parameters(), or gathered on
        demand in a one-rank run; with several ranks outside full_parameters() it raises (a
        gather is collective: one rank alone would wait for the others)."""
        for m in model.modules():
            own = [(n, self._ids[id(p)]) for n, p in m.named_parameters(recurse=False)
                   if id(p) in self._ids]
            if own:
                self._stage3_handles.append(m._register_state_dict_hook(self._full_entries(own)))

    def _full_entries(self, own):
        def hook(module, state_dict, prefix, local_metadata):
            if self._engine is None or self._gathered_all:
                return state_dict
            missing = [(n, tid) for n, tid in own
                       if tuple(self._params[tid].shape) != tuple(self._shapes[tid])]
            if not missing:
                return state_dict
            if self.world > 1:
                raise errors.UsageError(
                    "strata: model.state_dict() at stage 3 outside opt.full_parameters(): the "
                    "parameters are partitioned across %d ranks. On every rank: `with "
                    "opt.full_parameters(): sd = model.state_dict()`, or sd = opt.full_state_dict()"
                    % self.world)
            self._fetch(tuple(tid for _, tid in missing))
            for n, tid in missing:
                state_dict[prefix + n] = self._params[tid].data
                self._params[tid].data = self._empty
            return state_dict
        return hook

    @contextlib.contextmanager
    def full_parameters(self):
        """Every parameter holds its full tensor inside the block (stage 3 gathers them all;
        collective: every rank enters it; stages 0-2: nothing to do). For reading —
        model.state_dict(), evaluation, export; changes made inside are not kept."""
        self._check_usable()
        if self.stage < 3 or self._gathered_all:
            yield self._model
            return
        if self._n_arrived:
            raise errors.UsageError("strata: full_parameters() between backward() and step()")
        self._enter_collective("full_parameters")
        self._fetch(tuple(range(len(self._params))))
        self._gathered_all = True
        try:
            yield self._model
        finally:
            self._gathered_all = False
            for p in self._params:
                p.data = self._empty

    def full_state_dict(self):
        """model.state_dict() with every parameter whole (a copy; buffers and frozen parameters
        included). Collective at stage 3."""
        with self.full_parameters():
            return {k: v.detach().clone() for k, v in self._model.state_dict().items()}

    # ---- state ----
    def _read(self, tid, kind):
        """FP32 state of parameter tid as a CPU tensor (whatever torch's default device: C2)."""
        t = torch.empty(self._shapes[tid], dtype=torch.float32, device="cpu")
        if t.numel():
            self._engine.read_state(tid, kind, self._mem.host_address(t))
        return t

    def _checked(self, tid, kind, value):
        """`value` as a contiguous FP32 CPU tensor of parameter tid's shape, or InvalidArgumentError."""
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, device="cpu")
        if tuple(value.shape) != tuple(self._shapes[tid]):
            raise errors.InvalidArgumentError(
                "strata: load_state_dict: %s of '%s' has shape %s, the parameter %s; nothing was loaded"
                % (kind, self._name(self._params[tid]), tuple(value.shape), tuple(self._shapes[tid])))
        return value.detach().to(device="cpu", dtype=torch.float32).contiguous()

    def state_dict(self):
        """torch's optimizer format (torch.optim.AdamW.load_state_dict accepts it): per parameter
        index, 'step', 'exp_avg', 'exp_avg_sq' (FP32, whole tensors gathered from the ranks that
        own them) and 'master' (the FP32 master weights; equal to the parameters in fp32).
        Collective: every rank calls it and gets the whole state."""
        self._check_usable()
        self._enter_collective("state_dict")
        state = {}
        for tid in range(len(self._params)):  # (collective reads: every rank in tid order)
            step = torch.tensor(float(self._engine.tensor_step(tid)), device="cpu")  # its own
            state[tid] = {"step": step, "exp_avg": self._read(tid, "exp_avg"),
                          "exp_avg_sq": self._read(tid, "exp_avg_sq"), "master": self._read(tid, "master")}
        state = {k: state[tid] for k, tid in enumerate(self._tid_of)}  # torch's indices
        groups, i = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(i, i + len(g["params"])))
            i += len(g["params"])
            groups.append(d)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Loads torch's optimizer format (from this class or torch.optim.Adam/AdamW): moments,
        step, group hyper-parameters; the FP32 master from 'master' when present, else from the
        model's current parameters (so load the model's state_dict first). Collective: every rank
        passes the same state_dict."""
        self._check_usable()
        self._enter_collective("load_state_dict")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise errors.InvalidArgumentError(
                "strata: load_state_dict: the state has groups of %s parameters, this optimizer %s"
                % ([len(g["params"]) for g in groups], [len(g["params"]) for g in self.param_groups]))
        for gi, g in enumerate(groups):
            if "betas" in g and len(tuple(g["betas"])) != 2:
                raise errors.InvalidArgumentError(
                    "strata: load_state_dict: param_groups[%d] has betas %s (two values expected); "
                    "nothing was loaded" % (gi, g["betas"]))
        index = [i for g in groups for i in g["params"]]
        by_tid = sorted(range(len(index)), key=lambda k: self._tid_of[k])
        steps, values = [], []
        for tid, idx in ((self._tid_of[k], index[k]) for k in by_tid):  # all checked first
            # Each parameter's own step (torch's); a parameter without state never stepped: 0.
            st = state_dict["state"].get(idx)
            steps.append(int(float(st["step"])) if st is not None and "step" in st else
                         None if st is not None else 0)
            st = st or {}
            master = st.get("master")
            if master is None:
                master = self._current_param(tid)
            values.append([(kind, self._checked(tid, kind, v)) for kind, v in (
                ("master", master),
                ("exp_avg", st.get("exp_avg", torch.zeros(self._shapes[tid], device="cpu"))),
                ("exp_avg_sq", st.get("exp_avg_sq",
                                      torch.zeros(self._shapes[tid], device="cpu"))))])
        if any(s is not None and s < 0 for s in steps):
            raise errors.InvalidArgumentError(
                "strata: load_state_dict: a negative step count %s; nothing was loaded"
                % min(s for s in steps if s is not None))
        self._mem.synchronize()  # kernels queued earlier may still read the parameters (R12)
        self._engine.write_states([(tid, kind, self._mem.host_address(v))  # NVMe: each chunk once
                                   for tid, kinds in enumerate(values) for kind, v in kinds
                                   if v.numel()])
        self._mem.after_engine_wrote()
        top = max([s for s in steps if s is not None] or [0])
        self._engine.set_optimizer_step(top)  # a state without 'step' (not torch's) takes it
        self._engine_wrote_params()
        for tid, s in enumerate(steps):
            if s is not None and s != top:
                self._engine.set_tensor_step(tid, s)
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        self._sync_groups()

    def _current_param(self, tid):
        if self.stage < 3:
            return self._params[tid].detach().float()
        return self._read(tid, "master")

    def save_checkpoint(self, directory, client_state=None, blocking=True):
        """The engine's checkpoint (every rank's shard + a manifest, committed atomically; see
        docs/offload.md), with every group's lr, weight_decay, betas and eps, and `client_state`:
        the loop's own state (its step, data position, a scheduler's state_dict()), anything
        json.dumps takes, at most 1 MiB of JSON; rank 0's is kept. Collective.

        blocking=False: returns after the snapshot (the step, counters, groups and client_state
        captured, the optimizer state pinned where it lives); the shards are written in the
        background while training goes on. Rank 0 commits it once every rank's shard is durable:
        at the start of the first step() after the step in which every rank's writer had finished,
        or at the next wait_checkpoint(), save_checkpoint(), load_checkpoint() or close()
        (collective), which also raise a failure of the background writer; the previous
        checkpoint stays loadable until then. close() (or wait_checkpoint()) before the optimizer
        is dropped: a dropped engine only logs a failure. Returns the seconds the call blocked."""
        self._check_usable()
        self._enter_collective("save_checkpoint")
        text = ""
        if client_state is not None:
            try:
                text = json.dumps(client_state, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise errors.InvalidArgumentError(
                    "strata: save_checkpoint(client_state=...): not JSON (%s); nothing was written"
                    % e) from None
        self._sync_groups()
        t0 = time.perf_counter()
        shapes, aliases, extra, keep = self._checkpoint_model()
        self._engine.save_checkpoint(os.fspath(directory), text, shapes, aliases, extra,
                                     blocking=blocking)
        del keep  # the untrained tensors' copies: written during the call, whatever the mode
        return time.perf_counter() - t0

    def wait_checkpoint(self):
        """Waits for an asynchronous save (save_checkpoint(blocking=False)) and commits it
        (collective; nothing to do without one). Raises what failed it, on every rank. Returns
        the seconds it blocked."""
        t0 = time.perf_counter()
        if self._engine.checkpoint_pending():  # (the same on every rank: saves are collective)
            self._enter_collective("wait_checkpoint")
        self._engine.wait_checkpoint()
        return time.perf_counter() - t0

    @property
    def checkpoint_pending(self):
        """An asynchronous save is in flight or not yet committed by wait_checkpoint()."""
        return self._engine.checkpoint_pending()

    def _checkpoint_model(self):
        """What save_checkpoint records for `strata checkpoint export`: every trained parameter's
        shape and its other names in model.state_dict() (a tied weight's), and the state_dict's
        tensors strata does not train (frozen parameters, persistent buffers) as CPU copies."""
        shapes = [list(s) for s in self._shapes]
        aliases = [[] for _ in self._params]
        extra, keep, skipped = [], [], []
        for name, t in _state_dict_tensors(self._model):
            tid = self._ids.get(id(t))
            if tid is not None:
                if name != self._name(t):
                    aliases[tid].append(name)
                continue
            dtype = _SAFETENSORS_DTYPES.get(t.dtype)
            if dtype is None:
                skipped.append("%s (%s)" % (name, t.dtype))
                continue
            c = t.detach().to("cpu").contiguous()
            keep.append(c)
            extra.append((name, dtype, list(c.shape), self._mem.host_address(c),
                          c.numel() * c.element_size()))
        if skipped and not self._warned_skipped_export:
            self._warned_skipped_export = True
            warnings.warn("strata: save_checkpoint: tensors of a dtype safetensors has no name for "
                          "are not saved for export: %s" % ", ".join(skipped))
        return shapes, aliases, extra, keep

    def load_checkpoint(self, directory):
        """Restores a checkpoint written by save_checkpoint (verified before anything changes; the
        world size and stage may differ: the load reshards), with every group's lr, weight_decay,
        betas and eps as saved (as torch's load_state_dict restores them). Returns the client_state
        saved with it, or None. Collective. Between a step's backward and step() (micro-batches
        of an accumulation) the step's gradients are dropped first, as zero_grad() drops them,
        with a warning: they were computed from the weights the load replaces."""
        self._check_usable()
        if self._n_arrived or self._micro:
            warnings.warn("strata: load_checkpoint() between backward() and step(): this step's "
                          "gradients (%d micro-batch(es)) are dropped, as zero_grad() drops them; "
                          "the next backward starts the step afresh" % (self._micro + 1),
                          UserWarning, stacklevel=2)
            self._drop_step_gradients()
        self._enter_collective("load_checkpoint")
        self._mem.synchronize()  # kernels queued earlier may still read the parameters (R12)
        self._engine.load_checkpoint(os.fspath(directory))
        self._mem.after_engine_wrote()
        self._engine_wrote_params()
        self._synced = {}  # the engine's groups are the checkpoint's now
        for gi, g in enumerate(self.param_groups):
            g["lr"] = self._engine.lr(gi)
            g["weight_decay"] = self._engine.weight_decay(gi)
            g["betas"] = tuple(self._engine.betas(gi))
            g["eps"] = self._engine.eps(gi)
        text = self._engine.checkpoint_client_state()
        return json.loads(text) if text else None

    # ---- information ----
    @property
    def config(self):
        """The loaded config's fields (dict); ``self.config_yaml()`` for all of it."""
        return dict(self._cfg)

    def config_yaml(self):
        return self._config.to_yaml()

    @property
    def backend(self):
        """The communicator: "inprocess" (one rank), "mpi", "c10d(gloo)"."""
        return self._engine.backend

    def stats(self):
        """Seconds per phase summed over the steps (backward_s: the loss.backward() calls,
        including handing the gradients in (handin_s) and, at stages 2-3, reduce-scatters that
        overlap it; reduce_s, norm_s, optimizer_s, gather_s, grad_spill_s, step_s: the engine's),
        step counts, loss scale, bytes sent per collective, buckets_reduced (stages 2-3)."""
        s = self._engine.stats()
        s["backward_s"] = self._backward_s
        s["handin_s"] = self._handin_s
        return s

    def close(self):
        """Detaches the model (its parameters become ordinary tensors holding the current values)
        and drops the engine: its swap files are removed. The optimizer cannot be used after.
        An asynchronous save still in flight is finished first (wait_checkpoint(): collective,
        every rank closes alike) and its failure raised once the optimizer is closed."""
        pending = None
        if self._engine is not None and self._failed is None and self._engine.checkpoint_pending():
            self._enter_collective("wait_checkpoint")  # as wait_checkpoint(): every rank alike
            try:
                self._engine.wait_checkpoint()
            except Exception as e:  # raised below, after the engine is dropped
                pending = e
        self._close()
        if pending is not None:
            raise pending

    def _drop_at_exit(self):
        """Interpreter exit without close(): the engine goes now (swap files, NCCL, device
        memory), without a collective (ranks exit at different times; a rank leaving after an
        exception must not wait for the others); the parameters are emptied: no engine memory is
        left aliased for the interpreter's teardown to free on some thread later."""
        self._close(keep_values=False)

    def _close(self, keep_values=True):
        """Detaches the model and drops the engine. keep_values: the parameters get the current
        values (stage 3: read from every rank, collective); else they are emptied."""
        for h in self._hook_handles + getattr(self, "_stage3_handles", []):
            h.remove()
        self._hook_handles, self._stage3_handles, self._grad_accs = [], [], []
        if not keep_values:
            for p in self._params:
                p.data = self._mem.empty((0,), self._param_dtype)
        elif self._engine is not None and self._failed is None:
            for tid, p in enumerate(self._params):
                p.data = (self._engine_tensor(tid).clone() if self.stage < 3
                          else self._mem.to_device(self._read(tid, "master"), self._param_dtype))
            self._mem.synchronize()  # the clones read the engine's memory on torch's stream
        for p in self._params:
            _OWNER.pop(id(p), None)
        _LIVE.discard(self)
        self._engine = None
        self._mem.close()
        self._failed = "closed" if keep_values else "closed at interpreter exit"


# torch modules whose forward reads parameters of their children without calling them (stage 3
# gathers their whole subtree as one unit).
_WHOLE_UNITS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                torch.nn.TransformerDecoderLayer)


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                       torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def _state_dict_tensors(module, prefix=""):
    """(name, tensor) for every parameter and persistent buffer model.state_dict() holds, in its
    order and under each of its names, without calling state_dict() (no stage-3 gather)."""
    for n, p in module._parameters.items():
        if p is not None:
            yield prefix + n, p
    for n, b in module._buffers.items():
        if b is not None and n not in module._non_persistent_buffers_set:
            yield prefix + n, b
    for n, child in module._modules.items():
        if child is not None:
            yield from _state_dict_tensors(child, prefix + n + ".")


def _whole_unit_test(units):
    if units is None:
        return lambda m: isinstance(m, _WHOLE_UNITS)
    if callable(units) and not isinstance(units, type):
        return lambda m: isinstance(m, _WHOLE_UNITS) or bool(units(m))
    classes = tuple(units) if isinstance(units, (list, tuple)) else (units,)
    if not all(isinstance(c, type) for c in classes):
        raise errors.InvalidArgumentError("strata: stage3_units: module classes or a callable "
                                          "(module -> bool), not %r" % (units,))
    return lambda m: isinstance(m, _WHOLE_UNITS + classes)


# id(parameter) -> (weakref to it, weakref to the ZeroOptimizer that trains it): lets torch's
# clip_grad_norm_ and DistributedDataParallel recognize strata's parameters.
_OWNER = {}

# The seam to tensor memory (_memory.py): a model's first trained parameter -> its TensorMemory.
# tests/fakecuda/torch_stand_in.py replaces it to run the CUDA branch on the fake CUDA runtime.
_memory_factory = _memory.memory_for

# ZeroOptimizers not closed yet: closed at interpreter exit (review R8), while torch, the CUDA
# runtime and NCCL are still up, instead of whenever the last parameter tensor aliasing engine
# memory dies (possibly during the interpreter's teardown, on any thread).
_LIVE = weakref.WeakSet()


@atexit.register
def _close_at_exit():
    for opt in list(_LIVE):
        try:
            opt._drop_at_exit()
        except Exception as e:  # noqa: BLE001 (exit: say it, go on with the others)
            warnings.warn("strata: dropping a ZeroOptimizer at exit: %s" % e)


def _owner_of(p):
    entry = _OWNER.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    opt = entry[1]()
    return opt if opt is not None and opt._engine is not None else None


def _refuse_ddp(model):
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    if ddp is not None and isinstance(model, ddp):
        raise errors.UnsupportedError(
            "strata: ZeroOptimizer(DistributedDataParallel(model)): strata reduces the gradients "
            "across ranks itself, DDP would average them a second time; pass the bare module "
            "(ddp.module) and drop the DDP wrapper")


def _install_ddp_guard():
    """DistributedDataParallel around a model strata trains is refused: both would reduce the
    gradients (averaged twice: silently wrong from the second step on)."""
    cls = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    if cls is None or getattr(cls.__init__, "_strata_guard", False):
        return
    original = cls.__init__

    def __init__(self, module, *args, **kwargs):
        if isinstance(module, torch.nn.Module) and any(
                _owner_of(p) is not None for p in module.parameters()):
            raise errors.UnsupportedError(
                "strata: DistributedDataParallel around a model whose parameters a ZeroOptimizer "
                "trains: strata reduces the gradients across ranks itself, DDP would average them "
                "a second time; train the bare module (no DDP wrapper)")
        original(self, module, *args, **kwargs)

    __init__._strata_guard = True
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__


def _redirect(func, name, dispatch):
    """Makes torch's function `func` call `dispatch` instead, also where a script bound it before
    `import strata` (`from torch.nn.utils import clip_grad_norm_`): the function object's code is
    replaced by a call of `dispatch` (published as `name` in its module). Returns a copy of the
    original that runs torch's code. A function with a closure (not torch's plain functions) is
    left alone: only the module attribute then leads to strata."""
    inner = func
    while hasattr(inner, "__wrapped__"):  # torch 2.x: a _no_grad wrapper around the function
        inner = inner.__wrapped__
    original = getattr(inner, "_strata_original", None)
    if original is not None:
        return original
    original = types.FunctionType(inner.__code__, inner.__globals__, inner.__name__,
                                  inner.__defaults__, inner.__closure__)
    original.__kwdefaults__ = inner.__kwdefaults__
    original.__doc__ = inner.__doc__
    if not inner.__code__.co_freevars:
        inner.__globals__[name] = dispatch
        scope = {}
        exec("def stub(*args, **kwargs):\n    return %s(*args, **kwargs)\n" % name, {}, scope)
        inner.__code__ = scope["stub"].__code__
        inner.__defaults__ = inner.__kwdefaults__ = None
    inner._strata_original = original
    return original


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, **kwargs):
    """torch.nn.utils.clip_grad_norm_, which strata.torch installs in its place: parameters a
    ZeroOptimizer trains are clipped by ZeroOptimizer.clip_grad_norm_ (the global norm across
    ranks; their p.grad is None once handed to the engine); any other parameters by torch's."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners, others = {}, []
    for p in params:
        opt = _owner_of(p)
        if opt is None:
            others.append(p)
        else:
            owners.setdefault(id(opt), (opt, set()))[1].add(id(p))
    if not owners:
        return _TORCH_CLIP_NORM(params, max_norm, norm_type, error_if_nonfinite, **kwargs)
    if len(owners) > 1:
        raise errors.UnsupportedError("strata: clip_grad_norm_ over the parameters of %d "
                                      "ZeroOptimizers at once; clip each optimizer's" % len(owners))
    opt, mine = next(iter(owners.values()))
    with_grad = [p for p in others if p.grad is not None]
    if with_grad:
        raise errors.UnsupportedError(
            "strata: clip_grad_norm_ over parameters strata trains and %d that another optimizer "
            "trains: their norms cannot be combined; clip them separately" % len(with_grad))
    if len(mine) != len(opt._params):
        raise errors.UnsupportedError(
            "strata: clip_grad_norm_ over %d of the %d parameters this ZeroOptimizer trains: strata "
            "clips by the global norm of all of them (pass model.parameters())"
            % (len(mine), len(opt._params)))
    return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)


def clip_grad_value_(parameters, clip_value, *args, **kwargs):
    """torch.nn.utils.clip_grad_value_, which strata.torch redirects here: over parameters a
    ZeroOptimizer trains it would do nothing (their p.grad is None: the gradients are in the
    engine), so it raises UnsupportedError instead; any other parameters: torch's."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    mine = [p for p in params if _owner_of(p) is not None]
    if mine:
        raise errors.UnsupportedError(
            "strata: clip_grad_value_ over %d parameter(s) a ZeroOptimizer trains: their gradients "
            "are in strata's engine (p.grad is None), so it would clip nothing; strata clips by the "
            "global L2 norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)"
            % len(mine))
    return _TORCH_CLIP_VALUE(params, clip_value, *args, **kwargs)


# torch's clipping functions lead here, whatever the import order (their code is redirected);
# torch's own code still runs for parameters no ZeroOptimizer trains.
_TORCH_CLIP_NORM = _redirect(torch.nn.utils.clip_grad.clip_grad_norm_, "_strata_clip_grad_norm_",
                             clip_grad_norm_)
_TORCH_CLIP_VALUE = _redirect(torch.nn.utils.clip_grad.clip_grad_value_,
                              "_strata_clip_grad_value_", clip_grad_value_)
torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
torch.nn.utils.clip_grad_value_ = clip_grad_value_
torch.nn.utils.clip_grad.clip_grad_value_ = clip_grad_value_
_install_ddp_guard()


_ADAMW_LR = 1e-3  # torch.optim.AdamW's default lr
_DDP_BUCKET_BYTES = 25 << 20  # torch DistributedDataParallel's bucket_cap_mb default
# What a rank announces (_announce): every collective call and each step's first collective work.
_PHASES = ("state_dict()", "load_state_dict()", "save_checkpoint()", "load_checkpoint()",
           "full_parameters()", "wait_checkpoint()", "optimizer.state[p]()", "a step's backward",
           "a forward with gradients", "a forward under no_grad (evaluation)")


def _with_adamw_arguments(overrides, **given):
    """The overrides with AdamW's keyword arguments that were given appended (they win)."""
    extra = []
    for key, v in given.items():
        if v is None:
            continue
        if key == "betas":
            b = tuple(v)
            if len(b) != 2:
                raise errors.InvalidArgumentError("strata: betas=%r: two values (beta1, beta2)"
                                                  % (v,))
            extra.append("optimizer.betas=[%r, %r]" % (float(b[0]), float(b[1])))
        else:
            extra.append("optimizer.%s=%r" % (key, float(v)))
    if not extra:
        return overrides
    from .config import _override_list
    return _override_list(overrides) + extra


_UNREADABLE = object()  # _config_value: a config this module cannot read (strata's loader will)


def _config_value(config, overrides, section, key):
    """What the overrides or the config (a YAML path or a dict) give section.key, as text; None
    when neither gives it; _UNREADABLE for a config read only by strata's loader (a loaded
    Config, a file yaml cannot read: the loader reports it properly)."""
    path = "%s.%s" % (section, key)
    if isinstance(overrides, dict) and path in overrides:
        return str(overrides[path]).strip()
    if isinstance(overrides, (list, tuple, str)):
        items = [overrides] if isinstance(overrides, str) else list(overrides)
        for o in reversed(items):  # (the last one wins)
            k, _, v = str(o).partition("=")
            if k.strip() == path:
                return v.strip()
    doc = config
    if isinstance(config, (str, os.PathLike)):
        try:
            import yaml

            with open(config) as f:
                doc = yaml.safe_load(f)
        except Exception:  # noqa: BLE001 (unreadable or malformed)
            return _UNREADABLE
    elif not isinstance(config, dict):
        return None if config is None else _UNREADABLE  # a loaded Config has every key
    sec = doc.get(section) if isinstance(doc, dict) else None
    return str(sec[key]).strip() if isinstance(sec, dict) and key in sec else None


def _config_gives(config, overrides, section, key, value):
    """Whether the config or the overrides set section.key to `value` (compared as text)."""
    return _config_value(config, overrides, section, key) == value


def _config_sets(config, overrides, section, key):
    """Whether the config (a YAML path or a dict) or the overrides give section.key."""
    return _config_value(config, overrides, section, key) is not None


# How long the ranks may take to meet when strata makes the process group (every rank's
# interpreter, torch and the model starting up; on a loaded machine that is more than a collective
# timeout of seconds). The collectives themselves run with runtime.collective_timeout_s each (the
# c10d communicator passes it per operation), not with the group's timeout.
_GROUP_CONNECT_TIMEOUT_S = 300.0


_OPTIMIZERS = itertools.count()  # ZeroOptimizers built in this process (_enter_collective's keys)


def _default_store():
    """The default process group's store (torchrun's TCPStore), or None."""
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except (RuntimeError, AttributeError, ValueError):
        return None


def _launcher_group(timeout_s):
    """The process group to reduce over under torchrun (or after init_process_group): the default
    group if it is gloo, else a gloo group over the same ranks. None for a single process."""
    connect = datetime.timedelta(seconds=max(timeout_s, _GROUP_CONNECT_TIMEOUT_S))
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        if "MASTER_ADDR" not in os.environ:
            raise errors.UsageError(
                "strata: WORLD_SIZE=%s but no MASTER_ADDR: start the ranks with torchrun (or call "
                "torch.distributed.init_process_group first)" % os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", timeout=connect)
    if dist.get_world_size() == 1:
        return None
    group = dist.distributed_c10d._get_default_group()
    if dist.get_backend() != "gloo":
        group = dist.new_group(backend="gloo", timeout=connect)
    return group
