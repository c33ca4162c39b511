"""The injected entry shim (packaging/ftagent-entry.sh): the trainer always starts.

Real processes under the real ``/bin/sh``, with agents that cannot start the ways they fail
in training images: a file without exec permission, an ELF for another architecture, a
binary that needs a glibc symbol version this libc lacks (the loader's own error, as on
UBI8 or Ubuntu 18.04), a missing file, a noexec mount; and the real agent, which wraps the
trainer. Each time the trainer's output, arguments and exit status are its own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.agent_launcher import ftagent_launcher
from tests.conftest import ROOT

SHIM = ROOT / "packaging" / "ftagent-entry.sh"
TRAINER = ["sh", "-c", 'printf "%s|" "$@"; echo to-stderr >&2; exit 7', "trainer",
           "a b", "c'd", "--flag=$HOME"]
ARGS_SEEN = "a b|c'd|--flag=$HOME|"


def install(folder: Path) -> Path:
    """The init container's copy: the shim beside the agent, in a folder of its own."""
    folder.mkdir(exist_ok=True)
    shutil.copy(SHIM, folder / "ftagent-entry")
    return folder / "ftagent-entry"


def run(entry: Path, tmp: Path, *trainer: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp),
           "FTAGENT_FALLBACK_FILE": str(tmp / "fallback"), "FTAGENT_MAX_RESTARTS": "0",
           "FTAGENT_METRICS_PORT": "0"}
    return subprocess.run(["/bin/sh", str(entry), "--", *(trainer or TRAINER)],
                          capture_output=True, text=True, env=env, timeout=60)


def assert_fell_back(r: subprocess.CompletedProcess[str], tmp: Path, why: str) -> None:
    assert r.returncode == 7 and r.stdout == ARGS_SEEN  # the trainer's own, unwrapped
    lines = r.stderr.splitlines()
    assert lines[0].startswith("ftagent: not started, the trainer runs without fault "
                               "tolerance: ") and why in lines[0], r.stderr
    assert lines[1:] == ["to-stderr"]
    assert (tmp / "fallback").read_text() == lines[0] + "\n"


def _patched_elf(tmp: Path, old: bytes, new: bytes, offset: int | None = None) -> Path:
    data = bytearray(Path("/bin/true").read_bytes())
    if offset is not None:
        data[offset:offset + len(new)] = new
    else:
        at = data.index(old)
        data[at:at + len(new)] = new
    path = tmp / "agent" / "ftagent"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(bytes(data))
    path.chmod(0o755)
    return path


def test_agent_without_exec_permission(tmp_path: Path) -> None:
    entry = install(tmp_path / "agent")
    (tmp_path / "agent" / "ftagent").write_bytes(b"\x7fELF")
    assert_fell_back(run(entry, tmp_path), tmp_path, "exit status 126")


def test_agent_for_another_architecture(tmp_path: Path) -> None:
    agent = _patched_elf(tmp_path, b"", b"\xb7\x00", offset=18)  # e_machine: AArch64
    with pytest.raises(OSError, match="Exec format error"):  # as an arm64 bundle here
        subprocess.run([str(agent)], capture_output=True)
    assert_fell_back(run(install(tmp_path / "agent"), tmp_path), tmp_path,
                     "exit status 126")


def test_agent_needing_a_newer_glibc(tmp_path: Path) -> None:
    """A version requirement this libc does not define: the dynamic loader's error, the
    one a bundle built on a newer glibc gives on an older image."""
    agent = _patched_elf(tmp_path, b"GLIBC_2.", b"GLIBC_9.")
    r = subprocess.run([str(agent)], capture_output=True, text=True)
    assert r.returncode == 1 and "version `GLIBC_9." in r.stderr
    assert_fell_back(run(install(tmp_path / "agent"), tmp_path), tmp_path,
                     "version `GLIBC_9.")


def test_agent_missing(tmp_path: Path) -> None:
    assert_fell_back(run(install(tmp_path / "agent"), tmp_path), tmp_path,
                     "ftagent does not exist")


def test_fallback_with_nowhere_to_write_the_marker(tmp_path: Path) -> None:
    entry = install(tmp_path / "agent")
    env = {"PATH": os.environ["PATH"], "FTAGENT_FALLBACK_FILE": "/proc/nope/x"}
    r = subprocess.run(["/bin/sh", str(entry), "--", "sh", "-c", "echo ok; exit 5"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 5 and r.stdout == "ok\n"
    assert r.stderr.startswith("ftagent: not started") and len(r.stderr.splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare for a private noexec mount")
def test_agent_on_a_noexec_mount(tmp_path: Path) -> None:
    """The emptyDir mounted noexec: the real agent is there but cannot be executed; the
    shim itself still runs (``sh FILE`` needs no exec permission)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    agent = ftagent_launcher(tmp_path / "launcher" / "ftagent")
    script = (f'mount -t tmpfs -o noexec ftagent "{mnt}" && cp "{SHIM}" "{mnt}/ftagent-entry"'
              f' && cp "{agent}" "{mnt}/ftagent" && exec /bin/sh "{mnt}/ftagent-entry" -- "$@"')
    env = {"PATH": os.environ["PATH"], "FTAGENT_FALLBACK_FILE": str(tmp_path / "fallback")}
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                        "sh", *TRAINER], capture_output=True, text=True, env=env, timeout=60)
    assert_fell_back(r, tmp_path, "exit status 126")


def test_a_working_agent_wraps_the_trainer(tmp_path: Path) -> None:
    """The real agent (this checkout's ``ftagent``): the trainer runs under ``ftagent run``
    with its arguments intact, and the agent exits with the trainer's status."""
    entry = install(tmp_path / "agent")
    ftagent_launcher(tmp_path / "agent" / "ftagent")
    r = run(entry, tmp_path)
    assert r.returncode == 7 and r.stdout == ARGS_SEEN
    assert "not started" not in r.stderr and "[ftagent" in r.stderr  # the agent's log
    assert not (tmp_path / "fallback").exists()


def test_no_command(tmp_path: Path) -> None:
    r = subprocess.run(["/bin/sh", str(install(tmp_path / "agent")), "--"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no command" in r.stderr


def test_the_injected_commands_run_as_the_kubelet_would(tmp_path: Path) -> None:
    """The patch's own commands, run for real: the init container's script copies the
    bundle (shim and agent) and writes the CA from its env; the trainer container's new
    command then runs the trainer under the agent, which finds the CA where
    FTAGENT_TLS_CA says."""
    import copy

    import jsonpatch

    from ftagent.kube.inject import Settings, mutate

    bundle, agent_dir = tmp_path / "bundle", tmp_path / "agent"
    install(bundle)
    ftagent_launcher(bundle / "ftagent")
    busybox = shutil.which("busybox")  # the bundle's is static (build_bundle.static_shell)
    if busybox is None:
        pytest.skip("no busybox (make deps installs it)")
    shutil.copy(busybox, bundle / "busybox")
    agent_dir.mkdir()
    ca = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
    s = Settings(arbiter="127.0.0.1:9", arbiter_ca=lambda: ca, bundle_dir=str(bundle),
                 agent_dir=str(agent_dir))
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "labels": {"ftagent.io/inject": "true"}},
           "spec": {"containers": [{"name": "main", "image": "x", "command": TRAINER[:3],
                                    "args": TRAINER[3:]}]}}
    new = jsonpatch.apply_patch(pod, mutate(copy.deepcopy(pod), "ml", s).patch)
    init = new["spec"]["initContainers"][0]
    init_env = {e["name"]: e["value"] for e in init["env"]}
    subprocess.run(init["command"], env={"PATH": os.environ["PATH"], **init_env},
                   check=True, timeout=60)
    assert (agent_dir / "ca.crt").read_text() == ca + "\n"
    assert (agent_dir / "ftagent-entry").read_bytes() == SHIM.read_bytes()
    c = new["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert env["FTAGENT_TLS_CA"] == str(agent_dir / "ca.crt")
    env = {**env, "PATH": os.environ["PATH"], "FTAGENT_METRICS_PORT": "0",
           "FTAGENT_MAX_RESTARTS": "0", "FTAGENT_ARBITER": "", "FTAGENT_TOKEN_FILE": "",
           "HOME": str(tmp_path), "FTAGENT_FALLBACK_FILE": str(tmp_path / "fallback")}
    r = subprocess.run([*c["command"], *c["args"]], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 7 and r.stdout == ARGS_SEEN, r.stderr
    assert "[ftagent" in r.stderr and not (tmp_path / "fallback").exists()


def test_an_agent_that_hangs_is_given_up_on(tmp_path: Path) -> None:
    """A probe that never answers (a loader stuck on a network file system, say) is killed
    after FTAGENT_PROBE_TIMEOUT seconds and the trainer starts."""
    entry = install(tmp_path / "agent")
    agent = tmp_path / "agent" / "ftagent"
    agent.write_text("#!/bin/sh\nexec sleep 600\n")
    agent.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FTAGENT_PROBE_TIMEOUT": "1",
           "FTAGENT_FALLBACK_FILE": str(tmp_path / "fallback")}
    r = subprocess.run(["/bin/sh", str(entry), "--", *TRAINER], capture_output=True,
                       text=True, env=env, timeout=30)
    assert_fell_back(r, tmp_path, "no answer within 1 s")


SHELLS = [s for s in (["dash"], ["bash", "--posix"], ["busybox", "sh"])
          if shutil.which(s[0])]


@pytest.mark.parametrize("shell", SHELLS, ids=[s[0] for s in SHELLS])
def test_the_shells_of_training_images(shell: list[str], tmp_path: Path) -> None:
    """Debian/Ubuntu's dash, RHEL's bash, Alpine's busybox ash: the same fallback (a hung
    probe included) and the same wrapping by the real agent."""
    entry = install(tmp_path / "agent")
    agent = tmp_path / "agent" / "ftagent"
    agent.write_text("#!/bin/sh\nexec sleep 600\n")
    agent.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FTAGENT_PROBE_TIMEOUT": "1",
           "FTAGENT_FALLBACK_FILE": str(tmp_path / "fallback"), "FTAGENT_MAX_RESTARTS": "0",
           "FTAGENT_METRICS_PORT": "0"}
    r = subprocess.run([*shell, str(entry), "--", *TRAINER], capture_output=True,
                       text=True, env=env, timeout=30)
    assert_fell_back(r, tmp_path, "no answer within 1 s")
    agent.unlink()
    ftagent_launcher(agent)
    env["FTAGENT_PROBE_TIMEOUT"] = "60"  # the real probe loads what `ftagent run` loads
    r = subprocess.run([*shell, str(entry), "--", *TRAINER], capture_output=True,
                       text=True, env=env, timeout=90)
    assert r.returncode == 7 and r.stdout == ARGS_SEEN and "[ftagent" in r.stderr


# ------------------------------------------------------------------ what the image sets


def test_a_malformed_ftagent_variable_still_starts_the_trainer(tmp_path: Path) -> None:
    """The image sets an FTAGENT_* value `ftagent run` refuses: before, the agent exited 2
    and the trainer never started; now the probe sees it and the trainer runs, the line
    naming the variable."""
    entry = install(tmp_path / "agent")
    ftagent_launcher(tmp_path / "agent" / "ftagent")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FTAGENT_METRICS_PORT": "abc",
           "FTAGENT_FALLBACK_FILE": str(tmp_path / "fallback")}
    r = subprocess.run(["/bin/sh", str(entry), "--", *TRAINER], capture_output=True,
                       text=True, env=env, timeout=90)
    assert_fell_back(r, tmp_path, "FTAGENT_METRICS_PORT: 'abc' is not a valid int")


@pytest.mark.parametrize("hostile", [{"FTAGENT_AGENT_BIN": "/bin/true"},
                                     {"FTAGENT_PROBE_TIMEOUT": "0"},
                                     {"FTAGENT_PROBE_TIMEOUT": "1" + "0" * 30}])
def test_the_image_cannot_turn_the_agent_off(hostile: dict[str, str], tmp_path: Path) -> None:
    """Before, FTAGENT_AGENT_BIN=/bin/true replaced the agent (and the trainer: nothing
    ran, exit 0) and FTAGENT_PROBE_TIMEOUT=0 killed every probe at once. The agent's
    program is not the image's to choose, and a timeout out of 1-300 s is the default."""
    entry = install(tmp_path / "agent")
    ftagent_launcher(tmp_path / "agent" / "ftagent")
    r = subprocess.run(
        ["/bin/sh", str(entry), "--", *TRAINER], capture_output=True, text=True, timeout=90,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FTAGENT_MAX_RESTARTS": "0",
             "FTAGENT_METRICS_PORT": "0", "FTAGENT_FALLBACK_FILE": str(tmp_path / "fallback"),
             **hostile})
    assert r.returncode == 7 and r.stdout == ARGS_SEEN, r.stderr
    assert "not started" not in r.stderr and "[ftagent" in r.stderr


def _python_dir(folder: Path, manifest: dict[str, object]) -> Path:
    """The wheels path's folder with a manifest and no wheels: launch.py's checks only."""
    import json

    py = folder / "py"
    py.mkdir(parents=True)
    shutil.copy(ROOT / "packaging" / "launch.py", py / "launch.py")
    (py / "manifest.json").write_text(json.dumps(manifest))
    return py


@pytest.mark.skipif(not shutil.which("python3", path="/usr/bin:/bin"),
                    reason="no system python3")
@pytest.mark.parametrize(("manifest", "why"), [
    ({"pythons": ["3.99"], "glibc": {"x86_64": [2, 17], "aarch64": [2, 17]}},
     "here, the agent's wheels are for CPython 3.99"),
    ({"pythons": [], "glibc": {"s390x": [2, 17]}}, "no wheels for it (have s390x)"),
    ("not a manifest", "cannot read"),
])
def test_the_images_python_says_why_it_cannot(manifest: object, why: str,
                                                 tmp_path: Path) -> None:
    """The image's python3 for another version, another architecture (as an unknown one
    would be), a damaged copy: one line each, then the bundle is tried, then the trainer
    runs."""
    import platform

    if isinstance(manifest, dict) and manifest["pythons"] == []:
        manifest["pythons"] = [".".join(platform.python_version_tuple()[:2])]
    entry = install(tmp_path / "agent")
    _python_dir(tmp_path / "agent", manifest)  # type: ignore[arg-type]
    if manifest == "not a manifest":
        (tmp_path / "agent" / "py" / "manifest.json").write_text("{")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "FTAGENT_FALLBACK_FILE": str(tmp_path / "fallback")}
    r = subprocess.run(["/bin/sh", str(entry), "--", *TRAINER], capture_output=True,
                       text=True, env=env, timeout=90)
    assert_fell_back(r, tmp_path, why)
    line = r.stderr.splitlines()[0]
    assert "image Python: /usr/bin/python3" in line and "; bundle: " in line
    assert "ftagent does not exist" in line


def test_no_glibc_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """musl (Alpine) has no CS_GNU_LIBC_VERSION: the wheels path says so (pure check)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ftagent_launch",
                                                  ROOT / "packaging" / "launch.py")
    assert spec is not None and spec.loader is not None
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)

    def no_confstr(name: str) -> str:
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(os, "confstr", no_confstr)
    import platform
    here = ".".join(platform.python_version_tuple()[:2])
    why = launch.paths({"pythons": [here], "glibc": {os.uname().machine: [2, 17]}})
    assert why == "no glibc here (musl libc, as in Alpine?): the wheels need glibc 2.17+"
