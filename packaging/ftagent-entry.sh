#!/bin/sh
# ftagent-entry: the injected trainer's entry point. Runs `ftagent run -- COMMAND...` when
# the agent can start in this image, else COMMAND itself: the trainer always starts.
#
#   sh /opt/ftagent/ftagent-entry -- COMMAND [ARGS...]
#
# The agent is a self-contained binary, but it still needs the image's glibc (at least the
# bundle's floor), the CPU architecture it was built for and an exec-able mount. Whether
# it can start is found by starting it (`ftagent --version`): a loader error (a missing
# GLIBC_x.y symbol version), an exec format error (another architecture), a noexec mount
# or a missing file all end that probe with a non-zero status, and a probe that hangs is
# killed after $FTAGENT_PROBE_TIMEOUT seconds (default 30). Then this says why on
# stderr (one line, in the container's log), writes the same line to $FTAGENT_FALLBACK_FILE
# (default /tmp/ftagent-fallback; best effort: the root may be read-only) and execs the
# command unwrapped, so its output, exit status and signals are its own.
#
# POSIX sh only (dash, busybox ash, bash): the training image is all there is. It is run
# with `sh FILE`, so it needs no exec permission on its own mount.

case $0 in
    */*) here=${0%/*} ;;
    *) here=. ;;
esac
agent=${FTAGENT_AGENT_BIN:-$here/ftagent}
if [ "${1-}" = "--" ]; then
    shift
fi
if [ $# -eq 0 ]; then
    echo "ftagent-entry: no command to run (usage: ftagent-entry -- COMMAND [ARGS...])" >&2
    exit 2
fi

why=
if [ ! -e "$agent" ]; then
    why="$agent does not exist"
elif [ ! -f "$agent" ]; then
    why="$agent is not a file"
else
    # the probe, killed if it has not answered within $FTAGENT_PROBE_TIMEOUT seconds (a
    # hung probe must not keep the trainer from starting); the watchdog polls, so it ends
    # by itself within a second of the probe
    limit=${FTAGENT_PROBE_TIMEOUT:-30}
    out=$(
        "$agent" --version 2>&1 </dev/null &
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
    if [ "$rc" -ne 0 ]; then
        nl='
'
        first=${out%%"$nl"*}
        if [ "$rc" -eq 137 ] && [ -z "$first" ]; then
            first="no answer to --version within $limit s"
        fi
        why=$(printf 'it does not start here (exit status %s): %.300s' "$rc" "$first")
    fi
fi

if [ -n "$why" ]; then
    line="ftagent: not started, the trainer runs without fault tolerance: $why"
    printf '%s\n' "$line" >&2
    printf '%s\n' "$line" 2>/dev/null >"${FTAGENT_FALLBACK_FILE:-/tmp/ftagent-fallback}" || :
    exec "$@"
fi
exec "$agent" run -- "$@"
