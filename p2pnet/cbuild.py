"""Compiles the project's optional C extension modules (the simulator's `simulations.accel`, the
verifier's `verify.accel`) and finds them at run time, one way for both.

Owns: the compiler command (`sysconfig`'s CC, else `cc`), the platforms a module is built on,
writing the module under a temporary name and renaming it into place, the stamp a module is
compiled with (`-DP2PNET_STAMP="..."`, exposed as its `STAMP`), and `load`, which hands a
caller the built module only while that stamp matches the caller's sources.
Must not: know what any module computes (each builder names its sources, flags and stamp), or
be imported by a run for anything but `load` / `digest`.

A stamp is a sha256 over the module's sources (and whatever else must match, such as the Python
function it replaces), so an edited source makes an older build stale: `load` then warns and
returns None, and the caller runs its Python path. Nothing is downloaded; without a compiler
or the interpreter's headers `build` raises `RuntimeError` with the reason and the caller goes
on without the module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# x86_64 / aarch64 Linux and macOS: doubles are plain IEEE binary64 (no x87 excess precision);
# a builder may name fewer
PLATFORMS = {("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "x86_64"), ("darwin", "arm64")}
BUILD_TIMEOUT_S = 120


def compiler() -> list[str]:
    """The C compiler command: the one Python was built with (`sysconfig`'s CC), else `cc`."""
    return shlex.split(sysconfig.get_config_var("CC") or "cc")[:1] or ["cc"]


def off_platform(platforms: set[tuple[str, str]] = PLATFORMS) -> str | None:
    """Why a module for `platforms` is not built on this platform, else None."""
    where = (sys.platform, platform.machine())
    return None if where in platforms else f"built only on {sorted(platforms)}, not on {where}"


def unbuildable(platforms: set[tuple[str, str]] = PLATFORMS) -> str | None:
    """Why no module for `platforms` can be built here (another platform, no compiler, no
    Python.h), else None."""
    if (reason := off_platform(platforms)) is not None:
        return f"this C module is {reason}"
    if shutil.which(compiler()[0]) is None:
        return f"no C compiler here ({compiler()[0]})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "this interpreter's headers are not installed (a Debian python3.11 without python3.11-dev)"
    return None


def digest(paths: Iterable[Path], *extra: str) -> str:
    """A stamp: sha256 of the files' bytes, in order, then of each `extra` text."""
    hashed = hashlib.sha256()
    for path in paths:
        hashed.update(Path(path).read_bytes())
    for text in extra:
        hashed.update(text.encode())
    return hashed.hexdigest()


def target(directory: Path, module: str) -> Path:
    """Where module `module` built into `directory` goes (its name with this interpreter's suffix)."""
    return directory / (module + sysconfig.get_config_var("EXT_SUFFIX"))


def build(sources: list[Path], module: str, directory: Path, stamp: str, flags: list[str],
          platforms: set[tuple[str, str]] = PLATFORMS) -> Path:
    """Compile `sources` into extension module `module` in `directory`, carrying `stamp`; returns
    its path. Raises `RuntimeError` (with the compiler's output) on a platform not in `platforms`
    (where the module could compute otherwise than the Python path), when the compiler is
    missing, fails or takes over `BUILD_TIMEOUT_S`."""
    name = sources[0].name
    if (reason := off_platform(platforms)) is not None:
        raise RuntimeError(f"{name} is {reason}: it could compute otherwise there than the Python path")
    out = target(directory, module)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    extra = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    command = [*compiler(), *flags, "-fPIC", "-shared", *extra, f'-DP2PNET_STAMP="{stamp}"', "-I",
               sysconfig.get_paths()["include"], *map(str, sources), "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except OSError as exc:
        raise RuntimeError(f"no C compiler to build {name}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building {name} took over {exc.timeout} s:\n{' '.join(command)}") from exc
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building {name} failed:\n{' '.join(command)}\n{done.stderr}")
    os.replace(partial, out)  # a run importing it meanwhile sees the old file or the new one, whole
    return out


def import_file(path: Path, module: str) -> Any:
    """The extension module `module` from the built file `path` (one built elsewhere than its
    package: tests build into a temporary folder)."""
    spec = importlib.util.spec_from_file_location(module, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an extension module {module}")
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)
    return built


def load(package: str, module: str, stamp: Callable[[], str], pure_env: str, rebuild: str) -> Any:
    """`package.module` where it is built and carries `stamp()`; None where it is not built, where
    the environment sets `pure_env`=1 (A/B runs, tests of the Python path), or where its stamp
    differs (a stale build: warned about, naming the `rebuild` command, and never run). `stamp`
    is called only once the module imports (an install without the sources has no build either)."""
    if os.environ.get(pure_env) == "1" or sys.implementation.name != "cpython":
        return None
    try:
        built = importlib.import_module(f"{package}.{module}")
    except ImportError:
        return None
    if getattr(built, "STAMP", None) != stamp():
        warnings.warn(f"{built.__file__} was built from another tree's sources: running the Python path "
                      f"(rebuild: {rebuild})", RuntimeWarning, stacklevel=3)
        return None
    return built
