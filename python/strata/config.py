"""Loading a strata configuration for Python: a YAML file, a dict, or nothing (defaults).

Errors are :class:`strata.ConfigError` with strata's ``FILE:LINE:COL: KEY.PATH: message``.
"""
import os

from . import _strata


def _value_text(v):
    # An override's value is YAML text (strata parses it with the schema of its key).
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value_text(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _override_list(overrides):
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return ["%s=%s" % (k, _value_text(v)) for k, v in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    return [str(o) for o in overrides]


def load_config(config=None, overrides=None, *, defaults=None):
    """Returns the validated strata config (an opaque ``strata._strata.Config``).

    config: a path to a YAML file (str or os.PathLike), a dict with the same structure
        (``{"zero": {"stage": 2}, "offload": {"optimizer": {"tier": "nvme"}}}``), an already
        loaded Config, or None for the defaults (docs/config.md).
    overrides: ``{"zero.stage": 3}`` or ``["zero.stage=3"]``, applied after the file, as the
        CLI's ``--set``.
    defaults: overrides applied *before* `overrides` (what ZeroOptimizer derives from the model:
        model.parameters, and the precision of a model when no config is given).
    """
    ovr = _override_list(defaults) + _override_list(overrides)
    if isinstance(config, _strata.Config):
        if ovr:
            raise ValueError("strata: overrides cannot be applied to an already loaded Config")
        return config
    if config is None:
        return _strata.parse_config("{}", "<defaults>", ovr)
    if isinstance(config, (str, os.PathLike)):
        return _strata.load_config(os.fspath(config), ovr)
    if isinstance(config, dict):
        import yaml  # python3-yaml

        return _strata.parse_config(yaml.safe_dump(config, sort_keys=False), "<config dict>", ovr)
    raise TypeError("strata: config must be a path, a dict, a strata Config or None, not %s"
                    % type(config).__name__)
