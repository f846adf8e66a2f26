"""Run SGLang's server with kvxfer as a KV transfer backend:

    python -m kvxfer.sglang.launch <sglang.launch_server arguments> \\
        --disaggregation-transfer-backend kvxfer

SGLang picks its backend from a fixed list: ``--disaggregation-transfer-backend``
has a ``choices`` list (``DISAGG_TRANSFER_BACKEND_CHOICES``, in
``sglang/srt/arg_groups/choices.py`` on newer SGLang and
``sglang/srt/server_args.py`` on older), the scheduler turns the string into
the ``TransferBackend`` enum of ``sglang/srt/disaggregation/utils.py``, and
``get_kv_class(backend, class_type)`` in the same module maps it to classes
with an if/elif chain. prefill.py, decode.py and the bootstrap-server
starter bind ``TransferBackend`` and ``get_kv_class`` with ``from ... import``
when they are imported.

install() extends all three in this process: "kvxfer" is added to the choices
list (through SGLang's own ``add_disagg_transfer_backend_choices`` where it
exists), ``TransferBackend.KVXFER`` ("kvxfer") is added to the existing enum
class in place (so modules that already imported it see it), and
``get_kv_class`` is wrapped to answer kvxfer's classes for it; the wrapper
replaces the original in every ``sglang`` module already imported as well.
SGLang starts its scheduler, detokenizer and bootstrap-server processes with
multiprocessing's "spawn", which re-imports the parent's main module in each
child: run as ``python -m kvxfer.sglang.launch``, that module is this one,
and it calls install() again there before SGLang's modules load.

On SGLang with the plugin framework (``sglang.srt.plugins``), installing the
kvxfer package (``pip install ./python``) also registers install() as a
general plugin, which SGLang loads in every process: there plain
``python -m sglang.launch_server ... --disaggregation-transfer-backend kvxfer``
(or ``sglang serve``) works too.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import runpy
import sys

log = logging.getLogger("kvxfer")

#: The --disaggregation-transfer-backend value and TransferBackend value.
BACKEND = "kvxfer"
#: The TransferBackend member name.
MEMBER = "KVXFER"
#: Where SGLang keeps the choices list, newest first.
CHOICES_MODULES = ("sglang.srt.arg_groups.choices", "sglang.srt.server_args")
#: The command-line option install() adds kvxfer to.
OPTION = "--disaggregation-transfer-backend"

_argparse_hooked = False


def _classes():
    from . import conn

    return {
        "kvargs": conn.KVArgs,
        "manager": conn.KVManager,
        "sender": conn.KVSender,
        "receiver": conn.KVReceiver,
        "bootstrap_server": conn.KVBootstrapServer,
    }


def _import(name):
    """The module, or None when it (or a parent package) does not exist;
    a missing dependency of an existing module still raises."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            return None
        raise


def _extend_enum(cls, name, value):
    """Add member name = value to the Enum class cls in place (idempotent);
    returns the member. The class keeps its identity, so every module that
    imported it sees the member, and cls(value) finds it."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    if name in cls.__dict__:
        raise RuntimeError(f"{cls.__module__}.{cls.__qualname__} already has an attribute {name!r} that is not the {value!r} member")
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls
    if hasattr(cls, "_sort_order_") or any(hasattr(m, "_sort_order_") for m in cls._member_map_.values()):
        member._sort_order_ = len(cls._member_names_)
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ refuses member names
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    return member


def _wrap_get_kv_class(utils):
    """Wrap utils.get_kv_class (idempotent) and rebind it in the sglang
    modules that imported the original."""
    orig = utils.get_kv_class
    if getattr(orig, "_kvxfer_backend", False):
        return orig

    @functools.wraps(orig)
    def get_kv_class(transfer_backend, class_type):
        if getattr(transfer_backend, "value", transfer_backend) == BACKEND:
            return _classes().get(getattr(class_type, "value", class_type))
        return orig(transfer_backend, class_type)

    get_kv_class._kvxfer_backend = True
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "") or ""
        if (name == "sglang" or name.startswith("sglang.")) and getattr(mod, "get_kv_class", None) is orig:
            mod.get_kv_class = get_kv_class
    utils.get_kv_class = get_kv_class
    return get_kv_class


def _hook_argparse():
    """For an SGLang whose choices are a literal list in add_argument: add
    kvxfer to the choices of OPTION whenever a parser defines it."""
    global _argparse_hooked
    if _argparse_hooked:
        return
    orig = argparse._ActionsContainer.add_argument

    @functools.wraps(orig)
    def add_argument(self, *args, **kwargs):
        choices = kwargs.get("choices")
        if OPTION in args and choices is not None and BACKEND not in choices:
            kwargs["choices"] = list(choices) + [BACKEND]
        return orig(self, *args, **kwargs)

    argparse._ActionsContainer.add_argument = add_argument
    _argparse_hooked = True


def _add_choice() -> str:
    """Add kvxfer to SGLang's choices list; returns where."""
    for name in CHOICES_MODULES:
        mod = _import(name)
        choices = getattr(mod, "DISAGG_TRANSFER_BACKEND_CHOICES", None) if mod else None
        if choices is None:
            continue
        if BACKEND not in choices:
            adder = getattr(mod, "add_disagg_transfer_backend_choices", None)
            if adder is not None:
                adder([BACKEND])
            elif isinstance(choices, list):
                choices.append(BACKEND)
            else:
                raise RuntimeError(f"{name}.DISAGG_TRANSFER_BACKEND_CHOICES is a {type(choices).__name__}, not a list: "
                                   "kvxfer cannot add itself; apply the upstream patch in python/README.md")
        return f"{name}.DISAGG_TRANSFER_BACKEND_CHOICES"
    _hook_argparse()
    return f"argparse ({OPTION} choices)"


def install() -> None:
    """Register kvxfer as SGLang transfer backend "kvxfer" in this process
    (idempotent): the choice, TransferBackend.KVXFER and the get_kv_class
    branch. Raises ImportError when SGLang is not importable, RuntimeError
    when its disaggregation module does not have the TransferBackend enum and
    get_kv_class this patches (then apply the upstream patch in
    python/README.md)."""
    utils = _import("sglang.srt.disaggregation.utils")
    if utils is None:
        if _import("sglang") is None:
            raise ImportError("kvxfer.sglang.launch: SGLang is not importable here (no module 'sglang'); "
                              "install SGLang in this Python environment")
        raise RuntimeError("kvxfer.sglang.launch: this SGLang has no sglang.srt.disaggregation.utils, so it has no PD disaggregation to plug into")
    backend = getattr(utils, "TransferBackend", None)
    if backend is None or not hasattr(backend, "_value2member_map_") or not callable(getattr(utils, "get_kv_class", None)):
        raise RuntimeError("kvxfer.sglang.launch: sglang.srt.disaggregation.utils has no TransferBackend enum or get_kv_class; "
                           "apply the upstream patch in python/README.md")
    _extend_enum(backend, MEMBER, BACKEND)
    get_kv_class = _wrap_get_kv_class(utils)
    where = _add_choice()
    kind = getattr(utils, "KVClassType", None)
    manager = get_kv_class(backend(BACKEND), kind.MANAGER if kind is not None else "manager")
    if manager is not _classes()["manager"]:
        raise RuntimeError(f"kvxfer.sglang.launch: get_kv_class(TransferBackend.{MEMBER}, MANAGER) gives {manager!r} after patching")
    log.debug("kvxfer: registered SGLang transfer backend %r (TransferBackend.%s, get_kv_class, %s)", BACKEND, MEMBER, where)


def main(argv=None) -> int:
    """install(), then run ``sglang.launch_server`` as ``python -m`` would,
    with argv (default sys.argv[1:]) as its arguments. Returns its exit
    status; prints the reason and returns 1 when SGLang cannot be patched."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        install()
    except (ImportError, RuntimeError) as e:
        print(f"kvxfer.sglang.launch: {e}", file=sys.stderr)
        return 1
    # alter_sys=False keeps this module as __main__: spawned children
    # re-import it (and so install()) instead of sglang.launch_server.
    sys.argv = ["sglang.launch_server"] + args
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__mp_main__":
    # A process SGLang spawned from `python -m kvxfer.sglang.launch`:
    # multiprocessing re-imported this module as the child's main module.
    install()

if __name__ == "__main__":
    sys.exit(main())
