"""Import SGLang's own modules on a CPU-only machine.

SGLang's wheel is installed without its dependencies (``pip install --no-deps sglang``); its
pure-Python and torch modules import here once a few packages that cannot load on a CPU-only
torch are replaced by stubs. A stub only lets an ``import`` line succeed: every attribute of a
stubbed module is a placeholder that raises ``RuntimeError`` naming the package when it is called,
so a check that really reached one fails loudly instead of running a fake.

Stubbed, each for the reason given in ``CPU_STUBS``. Nothing else of SGLang is replaced.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

SGLANG_VERSION = "0.5.23"

# package -> why it cannot be imported on this CPU machine
CPU_STUBS = {
    "torchvision": "PyPI's torchvision wheels are CUDA builds; with the CPU torch their import fails "
                   "(operator torchvision::nms does not exist). SGLang's configs package imports it for "
                   "vision processors the K3 text model never runs.",
}


class _Unavailable:
    """Stands for any name of a stubbed package; raises when used as a value."""

    def __init__(self, qualname: str, reason: str):
        self._qualname, self._reason = qualname, reason

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._qualname} is a CPU stub ({self._reason}); this check reached it")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._qualname}.{name}", self._reason)

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __init__(self, name: str, reason: str):
        super().__init__(name)
        self.__path__ = []  # a package: submodule imports resolve through the finder
        self._reason = reason
        # transformers reads the version of any package that find_spec finds; a version below every
        # one it asks for keeps it off its torchvision paths
        self.__version__ = "0.0"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self.__name__}.{name}", self._reason)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        root = fullname.split(".")[0]
        if root in CPU_STUBS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name, CPU_STUBS[spec.name.split(".")[0]])

    def exec_module(self, module):
        pass


_FINDER = _StubFinder()


def install_cpu_stubs() -> None:
    """Put the stub finder first on ``sys.meta_path`` (idempotent)."""
    if _FINDER not in sys.meta_path:
        for name in list(sys.modules):
            if name.split(".")[0] in CPU_STUBS and not isinstance(sys.modules[name], _StubModule):
                del sys.modules[name]
        sys.meta_path.insert(0, _FINDER)


def uninstall_cpu_stubs() -> None:
    """Take the stub finder and the stub modules away (the rest of a test session sees no torchvision)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n, m in list(sys.modules.items()) if isinstance(m, _StubModule)]:  # a copy: a thread may import meanwhile
        del sys.modules[name]


def teardown() -> None:
    """Undo what this module did to the process: SGLang's process groups (and torch.distributed's default
    group) and runtime context, and the stubs. Later tests in the same pytest process start clean."""
    global _PUBLISHED
    if _PUBLISHED:
        import torch.distributed as dist
        from sglang.srt import runtime_context as rc
        from sglang.srt.distributed import parallel_state as ps

        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
        if dist.is_initialized():
            dist.destroy_process_group()
        rc.reset_context()
        _PUBLISHED = False
    uninstall_cpu_stubs()


def import_sglang(module: str):
    """``importlib.import_module`` of an SGLang module with the CPU stubs in place."""
    install_cpu_stubs()
    return importlib.import_module(module)


# ---------------------------------------------------------------------------------------------------------
# SGLang's runtime on one CPU process: its server arguments, model config and model classes, unchanged.

_PUBLISHED = False


def server_args(model_path: str, **kwargs):
    """SGLang's ``ServerArgs`` for a checkpoint directory, as ``sglang serve`` would build them on this
    machine: CPU device, no tokenizer (k3rl speaks token ids), no radix cache (SGLang's hybrid-KDA
    cache snapshots need a GPU platform)."""
    install_cpu_stubs()
    from sglang.srt.server_args import ServerArgs

    kw = dict(model_path=model_path, device="cpu", skip_tokenizer_init=True, load_format="dummy",
              disable_radix_cache=True)
    kw.update(kwargs)
    return ServerArgs(**kw)


def model_config(model_path: str, **kwargs):
    """SGLang's ``ModelConfig`` of a checkpoint: config.json read through SGLang's own config registry."""
    install_cpu_stubs()
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args(model_path, **kwargs))


def _publish_once(sa) -> None:
    """SGLang's process-wide runtime context and a one-rank gloo process group (once per process)."""
    global _PUBLISHED
    if _PUBLISHED:
        return
    import socket

    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps

    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=0, gpu_id=None))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel()
    _PUBLISHED = True


def build_sglang_k3(model_path: str):
    """SGLang's K3 model (``KimiK3ForConditionalGeneration``) for the checkpoint at ``model_path``, built by
    SGLang's loader (``_initialize_model``) with the quantization config SGLang derives from config.json.

    Two CPU-only adjustments, both outside the text backbone: the vision tower (out of k3rl's scope; the
    checkpoint has none) is built at a minimal size instead of the release's 27 layers, and the CUDA
    streams the text model allocates for overlap are placeholders (``torch.cuda.Stream`` needs CUDA;
    loading weights never touches them)."""
    from unittest import mock

    import torch

    install_cpu_stubs()
    from sglang.srt.configs.kimi_k3 import KimiK3VisionConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model

    sa = server_args(model_path)
    mc = model_config(model_path)
    _publish_once(sa)
    mc.hf_config.vision_config = KimiK3VisionConfig(
        vt_num_hidden_layers=1, vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2,
        qkv_hidden_size=32, text_hidden_size=mc.hf_config.text_config.hidden_size)
    load_config = LoadConfig(load_format="auto")
    quant_config = _get_quantization_config(mc, load_config)
    stream = lambda *a, **k: _Unavailable("torch.cuda.Stream", "no CUDA device on this machine")
    with mock.patch.object(torch.cuda, "Stream", stream), torch.device("cpu"):
        torch.set_default_dtype(mc.dtype)
        try:
            model = _initialize_model(mc, load_config, quant_config)
        finally:
            torch.set_default_dtype(torch.float32)
    return model, mc
