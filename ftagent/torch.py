"""``ftagent.torch.instrument()``: collective bandwidth and where a step's time goes, measured
in the trainer with no hand timing::

    import ftagent.torch
    model = DDP(model)
    ftagent.torch.instrument(model=model, optimizer=opt, dataloader=loader)

What it measures, and how:

* ``torch.distributed`` collectives (``all_reduce``, ``all_gather``,
  ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``broadcast``,
  ``all_to_all``, ``all_to_all_single``): the module's functions are wrapped (code that
  imported them by name before ``instrument()`` keeps the unwrapped ones). A synchronous
  call is timed around the call; ``async_op=True`` is timed to the *completion* of its
  work (a callback on ``work.get_future()``), not to its launch. Bytes as nccl-tests
  count them (all_gather / reduce_scatter: the total over ranks), the group's own size.
* DDP's gradient buckets (``model=`` a DDP module), op ``all_reduce_ddp``, timed by DDP's
  own reducer timer, not by a comm hook: a Python comm hook replaces DDP's C++ all-reduce
  with a Python call per bucket and a Python callback on the backend's thread (the GIL
  twice per bucket), which cost ~7 % of a 4 ms step here (bench/instrument.py). The
  reducer times the span from the first bucket's launch to the last one's completion on
  1 step in ``DDP_SAMPLE_EVERY`` (10, on CPU; ``close()`` restores DDP's 100) or in DDP's
  own 100 on CUDA (its events are read with a host wait: no more of those than DDP's
  default; the CUDA path is not exercised by this repository's tests). Counts and bytes
  are exact (every synced backward, every bucket); the *seconds are sampled*: the latest
  sampled span stands for the steps since the previous report, shared among the buckets
  by bytes (so each bucket's busbw is the step's effective reduction bandwidth). Steps
  before DDP's first sample wait for it. A user's comm hook is never replaced, and is
  timed the same way.
* Phases (``ftagent_phase_duration_seconds{phase}``): ``forward`` (module pre/post forward
  hooks), ``backward`` (from the gradient reaching the model's output to the end of the
  backward pass, DDP's last all-reduce wait included), ``optimizer`` (step pre/post hooks),
  ``data`` (time waiting in ``next()`` of the data loader's iterator).

Timing uses host clocks for CPU tensors (gloo) and CUDA events for CUDA tensors (read
when they have completed, never synchronising the device). Measurements are aggregated
in the trainer per (op, group size, power-of-two size bucket) and per phase, and sent
through the SDK socket (``ftagent.sdk``) at most ``1 / FLUSH_SECONDS`` times a second,
a few datagrams each; the agent turns them into algbw/busbw per op and size bucket.

Outside ``ftagent run`` (no ``FTAGENT_SDK_SOCKET``) it does nothing, not even import
torch. Nothing here raises into training code: a wrong use (no module, an optimizer
without hooks, instrumenting the same object twice) is one warning line, and every
measurement is guarded so that a failure in it loses the measurement, not the step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ftagent import sdk

log = logging.getLogger("ftagent.torch")

FLUSH_SECONDS = 0.25  # at most 4 reports a second
MAX_DATAGRAMS_PER_FLUSH = 6  # the agent's queue may hold only 10 (max_dgram_qlen)
MAX_PENDING_EVENTS = 4096  # CUDA event pairs waiting for completion; older are dropped
DDP_OP = "all_reduce_ddp"  # DDP's bucket all-reduce (busbw factor of all_reduce)
DDP_SAMPLE_EVERY = 10  # DDP's reducer times 1 step in this many (and its first 10)
DDP_DEFAULT_SAMPLE_EVERY = 100  # DDP's own default, restored by close()

# op -> (index of the positional argument whose bytes are counted, how: "one" tensor,
# "list" of tensors summed, "times_n" one tensor times the group size)
_OPS: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "one"),
    "broadcast": (0, "one"),
    "all_gather": (1, "times_n"),  # (tensor_list, tensor): output = n x tensor
    "all_gather_into_tensor": (0, "one"),  # (output, input): the output is the total
    "reduce_scatter": (1, "list"),  # (output, input_list): the inputs are the total
    "reduce_scatter_tensor": (1, "one"),  # (output, input): the input is the total
    "all_to_all": (1, "list"),  # (outputs, inputs): what this rank sends
    "all_to_all_single": (1, "one"),
    "all_gather_single": (0, "one"),  # torch 2.13's names for the *_tensor variants
    "reduce_scatter_single": (1, "one"),
}

_Tensor: Any = None  # torch.Tensor, once torch is imported (a forward hook's fast check)
_active: Instrumentation | None = None  # the process's one instrumentation (like sdk._client)
_warned: set[str] = set()


def _warn(msg: str) -> None:
    """One warning line per distinct message, never an exception."""
    if msg not in _warned and len(_warned) < 64:
        _warned.add(msg)
        log.warning("ftagent.torch: %s", msg)


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _bucket(nbytes: int) -> int:
    """Power-of-two size bucket (floor of log2) a collective is aggregated in."""
    return max(int(nbytes).bit_length() - 1, 0)


class Aggregator:
    """Measurements summed per key between flushes, sent through ``send_*`` (the SDK).

    Thread-safe: collectives complete on the backend's threads. ``clock`` is injected
    (tests); flushing happens on whichever thread records after ``interval`` elapsed."""

    def __init__(self, interval: float = FLUSH_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 send_collectives: Callable[[str, int, int, float, int], None] = sdk.collectives,
                 send_phase: Callable[[str, float, int], None] = sdk.phase_time) -> None:
        self.interval = interval
        self.clock = clock
        self.send_collectives = send_collectives
        self.send_phase = send_phase
        self.lock = threading.Lock()
        # (op, world, size bucket) -> [count, nbytes, seconds]; phase -> [count, seconds]
        self.collectives: dict[tuple[str, int, int], list[float]] = {}
        self.phases: dict[str, list[float]] = {}
        self.next_flush = clock() + interval
        self.sent = 0

    def collective(self, op: str, nbytes: int, seconds: float, world: int,
                   count: int = 1) -> None:
        """``count`` collectives of ``nbytes`` bytes each taking ``seconds`` in total."""
        key = (op, world, _bucket(nbytes))
        with self.lock:
            acc = self.collectives.get(key)
            if acc is None:
                self.collectives[key] = [count, nbytes * count, seconds]
            else:
                acc[0] += count
                acc[1] += nbytes * count
                acc[2] += seconds
        self.maybe_flush()

    def phase(self, name: str, seconds: float) -> None:
        with self.lock:
            acc = self.phases.get(name)
            if acc is None:
                self.phases[name] = [1, seconds]
            else:
                acc[0] += 1
                acc[1] += seconds
        self.maybe_flush()

    def maybe_flush(self) -> None:
        if self.clock() >= self.next_flush:
            self.flush()

    def flush(self, limit: int = MAX_DATAGRAMS_PER_FLUSH) -> None:
        """Send up to ``limit`` aggregates (phases first); the rest wait for the next
        flush, still accumulating, so a burst never overflows the agent's queue."""
        with self.lock:
            self.next_flush = self.clock() + self.interval
            phases = list(self.phases.items())[:limit]
            for name, _ in phases:
                del self.phases[name]
            colls = list(self.collectives.items())[:max(0, limit - len(phases))]
            for key, _ in colls:
                del self.collectives[key]
        for name, (count, seconds) in phases:
            self.send_phase(name, seconds, int(count))
        for (op, world, _), (count, nbytes, seconds) in colls:
            self.send_collectives(op, int(count), int(nbytes), seconds, world)
        self.sent += len(phases) + len(colls)


class _Clock:
    """Host clock for CPU work; CUDA events for CUDA work, read once completed."""

    def __init__(self, agg: Aggregator) -> None:
        self.agg = agg
        self.pending: list[tuple[Any, Any, Callable[[float], None]]] = []
        self.lock = threading.Lock()
        self._torch: Any = None

    def start(self, cuda: bool) -> Any:
        if not cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, token: Any, done: Callable[[float], None]) -> None:
        if isinstance(token, float):
            done(time.perf_counter() - token)
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        with self.lock:
            if len(self.pending) >= MAX_PENDING_EVENTS:
                del self.pending[0]
            self.pending.append((token, end, done))
        self.poll()

    def poll(self) -> None:
        """Resolve the CUDA event pairs that have completed (no device sync)."""
        if not self.pending:
            return
        with self.lock:
            ready = [p for p in self.pending if p[1].query()]
            if not ready:
                return
            self.pending = [p for p in self.pending if p not in ready]
        for start, end, done in ready:
            done(start.elapsed_time(end) / 1000.0)


class Instrumentation:
    """What ``instrument()`` set up: ``dataloader`` is the timed loader (the very object
    passed, when it could be timed in place); ``close()`` undoes everything (tests)."""

    def __init__(self, agg: Aggregator) -> None:
        self.agg = agg
        self.clock = _Clock(agg)
        self.dataloader: Any = None
        self.handles: list[Any] = []  # hook handles (removable)
        self.patched: dict[str, Callable[..., Any]] = {}  # name -> original function
        self.objects: set[int] = set()  # ids of modules/optimizers/loaders instrumented
        self.local = threading.local()
        self.ddp_timers: list[_DDPTimer] = []

    # ------------------------------------------------------------------ recording

    def record(self, op: str, nbytes: int, seconds: float, world: int) -> None:
        try:  # noqa: SIM105 - cheaper than suppress() on a hot path
            self.agg.collective(op, nbytes, seconds, world)
        except Exception:  # noqa: BLE001 - never into training
            pass

    def record_phase(self, name: str, seconds: float) -> None:
        try:
            self.clock.poll()
            self.agg.phase(name, seconds)
        except Exception:  # noqa: BLE001
            pass

    def record_phase_cpu(self, name: str, seconds: float) -> None:
        try:  # noqa: SIM105 - cheaper than suppress() on a hot path
            self.agg.phase(name, seconds)
        except Exception:  # noqa: BLE001
            pass

    def flush(self) -> None:
        """Send everything now (tests, exit); call it from the training thread."""
        try:
            self.clock.poll()
            self.poll_ddp()
            self.agg.flush(limit=1 << 30)
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ collectives

    def patch_collectives(self) -> None:
        import inspect

        import torch.distributed as dist

        for name, (arg, how) in _OPS.items():
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "__ftagent_original__", None) is not None:
                continue
            try:
                params = list(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                continue
            wrapper = self._wrap(dist, name, fn, (arg, params[arg]), how,
                                 params.index("group"), params.index("async_op"))
            self.patched[name] = fn
            setattr(dist, name, wrapper)

    def _wrap(self, dist: Any, op: str, fn: Callable[..., Any], arg: tuple[int, str],
              how: str, group_at: int, async_at: int) -> Callable[..., Any]:
        local = self.local
        at, name = arg

        def measure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, bool]:
            group = kwargs["group"] if "group" in kwargs else (
                args[group_at] if len(args) > group_at else None)
            world = dist.get_world_size(group)
            x = args[at] if len(args) > at else kwargs[name]
            if how == "list":
                nbytes, first = sum(_nbytes(t) for t in x), x[0]
            else:
                nbytes, first = _nbytes(x), x
                if how == "times_n":
                    nbytes *= world
            return nbytes, world, bool(first.is_cuda)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "inside", False):  # a collective built on another one
                return fn(*args, **kwargs)
            try:
                nbytes, world, cuda = measure(args, kwargs)
                async_op = bool(kwargs["async_op"] if "async_op" in kwargs else (
                    args[async_at] if len(args) > async_at else False))
                token = self.clock.start(cuda) if world >= 1 else None
            except Exception:  # noqa: BLE001 - bad arguments: torch itself will say
                token = None
            if token is None:
                return fn(*args, **kwargs)
            local.inside = True
            try:
                work = fn(*args, **kwargs)
            finally:
                local.inside = False
            self._finish(op, token, nbytes, world, work if async_op else None)
            return work

        wrapper.__ftagent_original__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(fn, "__name__", op)
        wrapper.__doc__ = getattr(fn, "__doc__", None)
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def _finish(self, op: str, token: Any, nbytes: int, world: int, work: Any) -> None:
        """Time to completion: now for a synchronous call, on the work's future else."""
        def done(seconds: float) -> None:
            self.record(op, nbytes, seconds, world)

        try:
            if work is None:
                self.clock.stop(token, done)
                return
            fut = work.get_future()

            def complete(f: Any) -> None:
                try:  # noqa: SIM105 - cheaper than suppress() on a hot path
                    self.clock.stop(token, done)
                except Exception:  # noqa: BLE001
                    pass

            fut.add_done_callback(complete)
        except Exception:  # noqa: BLE001 - a backend without futures: not measured
            pass

    # ------------------------------------------------------------------ DDP

    def ddp_timer(self, ddp: Any) -> _DDPTimer | None:
        """Time DDP's gradient buckets with DDP's own reducer timer, no comm hook."""
        try:
            import torch.distributed as dist

            timer = _DDPTimer(ddp, dist.get_world_size(getattr(ddp, "process_group", None)))
            if not _on_cuda(ddp.parameters()):
                # on CUDA DDP reads its events with a host wait at the next forward of a
                # sampled step: its own rate (100) is kept there, no more host waits
                ddp._set_ddp_runtime_logging_sample_rate(DDP_SAMPLE_EVERY)
                timer.resample = True
        except Exception as e:  # noqa: BLE001 - a DDP without its logger: not timed
            _warn(f"cannot time the DDP model's buckets ({type(e).__name__}: {e})")
            return None
        self.ddp_timers.append(timer)
        return timer

    def poll_ddp(self) -> None:
        """Turn the steps DDP reduced since the last poll into ``all_reduce_ddp``
        aggregates (main thread only: DDP's logging data is read where it is written)."""
        for timer in self.ddp_timers:
            try:  # noqa: SIM105 - cheaper than suppress() on a hot path
                timer.poll(self.agg)
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ phases

    def model_hooks(self, model: Any, ddp: _DDPTimer | None = None) -> None:
        """Forward pre/post hooks and, from the post hook, a gradient hook on the output
        that starts the backward timing. All closures are made here, once: a step runs
        three small functions and allocates a token, nothing else."""
        cuda = _on_cuda(model.parameters())
        inst = self
        clock = self.clock
        agg = self.agg
        perf = time.perf_counter
        forward_at: list[Any] = [None]
        backward_at: list[Any] = [None]
        synced = [False]  # this forward's backward reduces gradients (not no_sync())
        engine: list[Any] = []

        def record_forward(s: float) -> None:
            inst.record_phase("forward", s)

        def record_backward(s: float) -> None:
            inst.record_phase("backward", s)

        def pre(module: Any, args: Any) -> None:
            try:
                if clock.pending:
                    clock.poll()
                if ddp is not None and agg.clock() >= ddp.next_poll:
                    ddp.next_poll = agg.clock() + agg.interval
                    inst.poll_ddp()
                forward_at[0] = perf() if not cuda else clock.start(True)
            except Exception:  # noqa: BLE001
                forward_at[0] = None

        def end() -> None:
            token, backward_at[0] = backward_at[0], None
            try:
                if token is None:
                    return
                if cuda:
                    clock.stop(token, record_backward)
                else:
                    record_backward(perf() - token)
            except Exception:  # noqa: BLE001
                pass

        def queue_end() -> None:  # queued from a callback: runs after DDP's own one
            engine[0].queue_callback(end)

        def on_grad(grad: Any) -> None:
            try:
                backward_at[0] = perf() if not cuda else clock.start(True)
                if ddp is not None and synced[0]:
                    ddp.steps += 1
                engine[0].queue_callback(queue_end)
            except Exception:  # noqa: BLE001
                pass

        def post(module: Any, args: Any, output: Any) -> None:
            token, forward_at[0] = forward_at[0], None
            try:
                if token is not None:
                    if cuda:
                        clock.stop(token, record_forward)
                    else:
                        inst.record_phase_cpu("forward", perf() - token)
                out = _first_grad_tensor(output)
                if out is not None:
                    if not engine:
                        from torch.autograd import Variable

                        engine.append(Variable._execution_engine)
                    synced[0] = bool(getattr(module, "require_backward_grad_sync", True))
                    out.register_hook(on_grad)
            except Exception:  # noqa: BLE001
                pass

        self.handles.append(model.register_forward_pre_hook(pre))
        self.handles.append(model.register_forward_hook(post))

    def optimizer_hooks(self, optimizer: Any) -> None:
        params = (p for g in getattr(optimizer, "param_groups", ()) for p in g["params"])
        cuda = _on_cuda(params)
        inst = self
        clock = self.clock
        perf = time.perf_counter
        started: list[Any] = [None]

        def record(s: float) -> None:
            inst.record_phase("optimizer", s)

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            try:
                started[0] = perf() if not cuda else clock.start(True)
            except Exception:  # noqa: BLE001
                started[0] = None

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            token, started[0] = started[0], None
            if token is not None:
                try:
                    if cuda:
                        clock.stop(token, record)
                    else:
                        inst.record_phase_cpu("optimizer", perf() - token)
                except Exception:  # noqa: BLE001
                    pass

        self.handles.append(optimizer.register_step_pre_hook(pre))
        self.handles.append(optimizer.register_step_post_hook(post))

    def timed_loader(self, loader: Any) -> Any:
        """The loader, timed in place (its class swapped for a subclass whose ``__iter__``
        times ``next()``) when possible, else a wrapper to iterate instead."""
        inst = self

        def timed(it: Iterator[Any]) -> Iterator[Any]:
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                inst.record_phase("data", time.perf_counter() - t0)
                yield item

        cls = type(loader)
        base_iter = getattr(cls, "__iter__", None)

        def __iter__(self: Any) -> Iterator[Any]:  # noqa: N807
            return timed(iter(base_iter(self)))  # type: ignore[misc]

        try:
            sub = type(cls.__name__, (cls,), {
                "__iter__": __iter__, "__module__": cls.__module__,
                "__qualname__": cls.__qualname__, "__ftagent_timed__": True})
            loader.__class__ = sub
            return loader
        except TypeError:  # a builtin (list, generator): iterate the wrapper
            return _TimedIterable(loader, timed)

    def close(self) -> None:
        """Remove the hooks and restore ``torch.distributed`` (DDP's comm hook stays: DDP
        cannot unregister one)."""
        global _active
        self.flush()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for timer in self.ddp_timers:
            try:
                if timer.resample:
                    timer.ddp._set_ddp_runtime_logging_sample_rate(DDP_DEFAULT_SAMPLE_EVERY)
            except Exception:  # noqa: BLE001
                pass
        self.ddp_timers.clear()
        if self.patched:
            import torch.distributed as dist

            for name, fn in self.patched.items():
                setattr(dist, name, fn)
            self.patched.clear()
        if _active is self:
            _active = None


class _DDPTimer:
    """DDP's gradient reduction, timed by DDP itself: the reducer's runtime statistics
    (host clock on CPU, CUDA events on CUDA) time the span from the first bucket's
    all-reduce launch to the last one's completion on a sampled step (DDP's first 10, then
    1 in ``DDP_SAMPLE_EVERY`` on CPU, 1 in DDP's default 100 on CUDA). Counts and bytes
    are exact (every synced backward, every bucket); the seconds of the steps since the
    last poll are the latest sample's span times their number, shared among the buckets
    by their bytes, so busbw per bucket is the step's effective bandwidth. A comm hook,
    the user's own included, is timed the same way and never replaced."""

    def __init__(self, ddp: Any, world: int) -> None:
        self.ddp = ddp
        self.world = world
        self.steps = 0  # synced backward passes not yet reported (on_grad counts them)
        self.span: float | None = None  # seconds of the latest sampled step's reduction
        self.iteration: Any = None
        self.sizes: list[int] = []
        self.next_poll = 0.0
        self.resample = False  # DDP's sampling rate was raised (CPU): close() restores it

    def poll(self, agg: Aggregator) -> None:
        if not self.steps:
            return
        data = self.ddp._get_ddp_logging_data()
        comm = data.get("backward_comm_time")
        if isinstance(comm, int) and comm > 0 and data.get("iteration") != self.iteration:
            self.iteration, self.span = data.get("iteration"), comm / 1e9
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        self.sizes = [int(x) for x in str(sizes).split(",") if x.strip().isdigit()][:1024]
        total = sum(self.sizes)
        if self.span is None or not total:
            return  # no sampled step yet: the steps wait for one
        steps, self.steps = self.steps, 0
        for size in self.sizes:
            agg.collective(DDP_OP, size, steps * self.span * size / total, self.world,
                           count=steps)


class _TimedIterable:
    """A loader that cannot be timed in place: iterate this instead."""

    def __init__(self, loader: Any, timed: Callable[[Iterator[Any]], Iterator[Any]]) -> None:
        self.loader = loader
        self.timed = timed

    def __iter__(self) -> Iterator[Any]:
        return self.timed(iter(self.loader))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _on_cuda(params: Any) -> bool:
    for p in params:
        return bool(getattr(p, "is_cuda", False))
    return False


def _first_grad_tensor(output: Any, depth: int = 0) -> Any:
    """The first tensor requiring grad in a forward's output (a tensor, a tuple/list, a
    dict or an HF ``ModelOutput``), at most 3 levels deep; None if there is none."""
    global _Tensor
    if _Tensor is None:
        import torch

        _Tensor = torch.Tensor
    if isinstance(output, _Tensor):
        return output if output.requires_grad else None
    if depth >= 3:
        return None
    items = output.values() if isinstance(output, dict) else (
        output if isinstance(output, (tuple, list)) else ())
    for x in list(items)[:16]:
        t = _first_grad_tensor(x, depth + 1)
        if t is not None:
            return t
    return None


def instrument(model: Any = None, optimizer: Any = None, dataloader: Any = None, *,
               collectives: bool = True, flush_seconds: float = FLUSH_SECONDS,
               ) -> Instrumentation | None:
    """Time collectives (and DDP's buckets when ``model`` is DDP), forward/backward on
    ``model``, the ``optimizer``'s step and the wait for the ``dataloader``'s batches.

    Returns the ``Instrumentation`` (``.dataloader`` is the timed loader: the same object
    when it could be timed in place), or None outside ``ftagent run``. Calling it again
    adds what was not instrumented yet; an object given twice is a warning."""
    global _active
    if not os.environ.get(sdk.ENV):
        return None
    try:
        if _active is None:
            _active = Instrumentation(Aggregator(interval=flush_seconds))
            import atexit

            atexit.register(_active.flush)
        inst = _active
        if collectives and not inst.patched:
            inst.patch_collectives()
        _instrument_objects(inst, model, optimizer, dataloader)
        return inst
    except Exception as e:  # noqa: BLE001 - never into training
        _warn(f"instrument() failed ({type(e).__name__}: {e}); training goes on untimed")
        return _active


def _instrument_objects(inst: Instrumentation, model: Any, optimizer: Any,
                        dataloader: Any) -> None:
    if model is not None:
        if not hasattr(model, "register_forward_pre_hook"):
            _warn(f"model= takes a torch.nn.Module, not {type(model).__name__}: not timed")
        elif id(model) in inst.objects:
            _warn("this model is already instrumented: the second call ignores it")
        else:
            inst.objects.add(id(model))
            timer = None
            if hasattr(model, "_get_ddp_logging_data") and hasattr(model, "reducer"):
                timer = inst.ddp_timer(model)
            inst.model_hooks(model, timer)
    if optimizer is not None:
        if not hasattr(optimizer, "register_step_pre_hook"):
            _warn(f"optimizer= takes a torch.optim.Optimizer, not {type(optimizer).__name__}: "
                  "not timed")
        elif id(optimizer) in inst.objects:
            _warn("this optimizer is already instrumented: the second call ignores it")
        else:
            inst.objects.add(id(optimizer))
            inst.optimizer_hooks(optimizer)
    if dataloader is not None:
        if getattr(type(dataloader), "__ftagent_timed__", False) or isinstance(
                dataloader, _TimedIterable):
            _warn("this data loader is already instrumented: the second call ignores it")
            inst.dataloader = dataloader
        elif not hasattr(dataloader, "__iter__"):
            _warn(f"dataloader= takes an iterable, not {type(dataloader).__name__}: not timed")
        else:
            inst.dataloader = inst.timed_loader(dataloader)
