#!/bin/sh
# ftagent-entry: the injected trainer's entry point. Runs `ftagent run -- COMMAND...` when
# the agent can start in this image, else COMMAND itself: the trainer always starts.
#
#   sh /opt/ftagent/ftagent-entry -- COMMAND [ARGS...]
#
# Two ways to run the agent, tried in this order (docs/compatibility.md says which images
# take which, measured):
#
# 1. "wheels": the image's own Python (python3, python3.1X, python on PATH) runs
#    py/launch.py with the agent's wheels vendored beside this file per CPython version
#    and architecture (manylinux2014: glibc 2.17 and newer). `-I -S`: the image's
#    PYTHON* variables and site-packages are not read.
# 2. "bundle": the self-contained program ./ftagent (PyInstaller, its own Python), for
#    images with no usable Python; it needs the glibc it was built on.
#
# Whether a way works is found by asking it (`--probe`, `--ftagent-entry-probe`:
# ftagent/cmd/probe.py): everything `ftagent run` loads, the FTAGENT_* environment parsed,
# a temporary folder made. A loader error (a missing GLIBC_x.y symbol version), an exec
# format error (another architecture), a noexec mount, a missing file, musl libc, a
# malformed FTAGENT_* value all end that probe with a non-zero status, and a probe that
# hangs is killed after $FTAGENT_PROBE_TIMEOUT seconds (1-300, default 30). When neither
# way works this says why on stderr (one line, in the container's log), writes the same
# line to $FTAGENT_FALLBACK_FILE (default /tmp/ftagent-fallback; best effort: the root may
# be read-only) and execs the command unwrapped, so its output, exit status and signals
# are its own.
#
# Nothing in the image's environment chooses the agent's program: the image cannot swap
# the agent for something else and so turn it off without a line.
#
# POSIX sh only (dash, busybox ash, bash): the training image is all there is. The pod runs
# it with the static busybox beside it (`busybox sh FILE`: images without /bin/sh, e.g.
# distroless, start it too), so it needs no exec permission of its own, and borrows
# busybox's `sleep` where the image has none.

case $0 in
    */*) here=${0%/*} ;;
    *) here=. ;;
esac
agent=$here/ftagent
if ! command -v sleep >/dev/null 2>&1 && [ -x "$here/busybox" ]; then
    sleep() { "$here/busybox" sleep "$@"; }
fi
if [ "${1-}" = "--" ]; then
    shift
fi
if [ $# -eq 0 ]; then
    echo "ftagent-entry: no command to run (usage: ftagent-entry -- COMMAND [ARGS...])" >&2
    exit 2
fi

limit=${FTAGENT_PROBE_TIMEOUT:-30}
case $limit in
    '' | *[!0-9]* | 0 | 0*) limit=30 ;;
esac
if [ "${#limit}" -gt 3 ] || [ "$limit" -gt 300 ]; then
    limit=30
fi
nl='
'

# probe CMD...: runs CMD, killed if it has not answered within $limit seconds (a hung probe
# must not keep the trainer from starting; the watchdog polls, so it ends by itself within
# a second of the probe). Sets $why to "" when it exited 0, else to its first line.
probe() {
    out=$(
        "$@" 2>&1 </dev/null &
        pid=$!
        (
            n=0
            while kill -0 "$pid" 2>/dev/null; do
                if [ "$n" -ge "$limit" ]; then
                    kill -9 "$pid" 2>/dev/null
                    break
                fi
                sleep 1
                n=$((n + 1))
            done
        ) >/dev/null 2>&1 </dev/null &
        wait "$pid" 2>/dev/null  # (no "Killed" from the shell)
    )
    rc=$?
    why=
    if [ "$rc" -ne 0 ]; then
        first=${out%%"$nl"*}
        if [ "$rc" -eq 137 ] && [ -z "$first" ]; then
            first="no answer within $limit s"
        fi
        why=$(printf '%.300s (exit status %s)' "$first" "$rc")
    fi
}

# 1. the image's Python with the vendored wheels
py_why=
if [ -f "$here/py/launch.py" ]; then
    seen=
    for name in python3 python3.13 python3.12 python3.11 python3.10 python3.14 python; do
        py=$(command -v "$name" 2>/dev/null) || continue
        case $py in
            /*) ;;
            *) continue ;;  # an alias or a function, not a program
        esac
        case " $seen " in
            *" $py "*) continue ;;
        esac
        seen="$seen $py"
        probe "$py" -I -S "$here/py/launch.py" --probe
        if [ -z "$why" ]; then
            exec "$py" -I -S "$here/py/launch.py" run -- "$@"
        fi
        if [ -z "$py_why" ]; then
            py_why="$py: $why"
        fi
    done
    if [ -z "$py_why" ]; then
        py_why="no python3 on PATH"
    fi
fi

# 2. the self-contained bundle
musl=
for f in /lib/ld-musl-*.so.1; do
    if [ -e "$f" ]; then
        musl=$f
    fi
done
if [ ! -e "$agent" ]; then
    why="$agent does not exist"
elif [ ! -f "$agent" ]; then
    why="$agent is not a file"
elif [ -n "$musl" ] && [ ! -e /lib64/ld-linux-x86-64.so.2 ] && [ ! -e /lib/ld-linux-aarch64.so.1 ]; then
    why="musl libc ($musl, as in Alpine): the bundle needs glibc"
else
    probe "$agent" --ftagent-entry-probe
    if [ -z "$why" ]; then
        exec "$agent" run -- "$@"
    fi
    why="it does not start here: $why"
fi

if [ -n "$py_why" ]; then
    why="image Python: $py_why; bundle: $why"
fi
line="ftagent: not started, the trainer runs without fault tolerance: $why"
printf '%s\n' "$line" >&2
printf '%s\n' "$line" 2>/dev/null >"${FTAGENT_FALLBACK_FILE:-/tmp/ftagent-fallback}" || :
exec "$@"
