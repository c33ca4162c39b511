# ruff: noqa: UP031 - runs on any Python 3 to say that it is too old: no f-strings, no .format
"""Run the agent with the training image's own Python (the "wheels" path of the entry shim).

    PYTHON -I -S /opt/ftagent/py/launch.py --probe        (the shim's check)
    PYTHON -I -S /opt/ftagent/py/launch.py run -- CMD...  (the agent)

Beside this file (packaging/build_vendor.py makes it): ``manifest.json``, ``any/`` (the
pure-Python packages and ftagent itself), ``ARCH/`` (wheels for any CPython 3 of that
architecture: abi3 and binaries, py-spy in ``ARCH/bin``) and ``ARCH/cpXY/`` (wheels for one
CPython version). ``-I -S``: the image's ``PYTHON*`` variables, user site and site-packages
are never read, so its own (older) protobuf or grpcio cannot shadow the agent's; the trainer
the agent starts gets the environment as it was.

The checks come first and say in one line why this Python cannot run the agent (another
implementation or version, another architecture, no glibc or an older one than the wheels
need). Written for any Python 3 (no f-strings), so that an old one says so itself.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHES = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}


def glibc():
    """(major, minor) of the C library when it is glibc, else None (musl, ...)."""
    try:
        v = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return None
    parts = v.split()
    if len(parts) != 2 or parts[0] != "glibc":
        return None
    try:
        return tuple(int(x) for x in parts[1].split(".")[:2])
    except ValueError:
        return None


def paths(manifest):
    """The folders to put first on sys.path, or a one-line reason why this Python can't."""
    version = "%d.%d" % tuple(sys.version_info[:2])
    name = getattr(getattr(sys, "implementation", None), "name", "?")
    if name != "cpython":
        return "this is %s, the agent's wheels are for CPython" % name
    if version not in manifest["pythons"]:
        return "Python %s here, the agent's wheels are for CPython %s" % (
            version, ", ".join(manifest["pythons"]))
    machine = os.uname()[4]
    arch = ARCHES.get(machine)
    if arch is None or arch not in manifest["glibc"]:
        return "architecture %s: no wheels for it (have %s)" % (
            machine, ", ".join(sorted(manifest["glibc"])))
    libc = glibc()
    floor = tuple(manifest["glibc"][arch])
    if libc is None:
        return "no glibc here (musl libc, as in Alpine?): the wheels need glibc %d.%d+" % floor
    if libc < floor:
        return "glibc %d.%d here, the wheels need %d.%d+" % (libc + floor)
    found = [os.path.join(HERE, arch, "cp" + version.replace(".", "")),
             os.path.join(HERE, arch), os.path.join(HERE, "any")]
    for folder in found:
        if not os.path.isdir(folder):
            return "%s is missing (a partial copy?)" % folder
    return found


def main():
    try:
        with open(os.path.join(HERE, "manifest.json")) as f:
            manifest = json.load(f)
        found = paths(manifest)
    except Exception as e:  # a damaged copy: say so in one line, never a traceback
        found = "cannot read %s/manifest.json: %s" % (HERE, e)
    if not isinstance(found, list):
        sys.stdout.write(found + "\n")
        return 3
    sys.path[:0] = found
    if sys.argv[1:] == ["--probe"]:
        from ftagent.cmd.probe import main as probe
        return probe()
    from ftagent.cli import main as ftagent
    sys.argv[0] = "ftagent"
    return ftagent(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
