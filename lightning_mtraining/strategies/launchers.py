"""The strategies' process launchers (Trainer and Fabric): the strategy's checks before any other process starts,
and no local rank left running after one fails.

Note [No rank outlives a failure]
---------------------------------
Under Lightning's subprocess launcher (``Trainer(devices=N)`` run as a script) the launching process is local rank
0 and starts ranks 1 .. N-1 as child processes. Lightning watches the children (a thread polling every 5 s) and,
when one exits with an error, kills every process of the node at once, the launching one included, which may then
be killed before it prints its own report of the same failure. When the launching process itself fails, Lightning
does nothing: a child that stalls (in user code, or in a collective that waits on the failed rank) keeps running
after the job has ended. :class:`LocalRanks` replaces Lightning's watcher with one rule for both directions:

- this process fails: the children get ``grace_s`` seconds to end on their own (a failure every rank finds ends
  them within a second or two, each with its one-line report, Note [Failures that speak once] in
  :mod:`lightning_mtraining.core.errors`); those still running are killed (SIGKILL: SIGTERM does not
  reliably end a process blocked in a collective), then the error goes on;
- a child fails: this process gets ``grace_s`` seconds to end on its own (it usually fails the same way, or its
  collective errors out once the child's sockets close), then every child and this process are killed.

Either way no process of the node outlives the job. Other nodes are their own launchers' to end (their collectives
fail once this node's ranks are gone). With Fabric, the script goes on after ``fabric.launch()``: a failure there
is this process's when it ends with an uncaught exception (``sys.last_value``, set before the interpreter's exit
handlers run), which an exit handler turns into :meth:`LocalRanks.end_after_failure`.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricSubprocessScriptLauncher,
)
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_mtraining.core.errors import claim_first_failure, told_the_others_first

__all__ = ["CheckedMultiProcessingLauncher", "CheckedSubprocessScriptLauncher", "FabricSubprocessScriptLauncher",
           "LocalRanks"]

# SIGKILL: SIGTERM does not reliably end a process blocked in a collective (Lightning's watcher uses SIGKILL for the
# same reason); Windows has only SIGTERM.
_KILL = signal.SIGTERM if sys.platform == "win32" else signal.SIGKILL


class LocalRanks(threading.Thread):
    """The child processes (local ranks 1 .. N-1) the launching process started, ended by Note [No rank outlives a
    failure]: :meth:`end_after_failure` when this process fails; the thread itself when a child fails.

    Args:
        children: the child processes, local rank ``i + 1`` at index ``i``.
        rank: this process's global rank (for the lines it prints).
        grace_s: how long a failing rank's peers may take to end on their own before they are killed.
        poll_s: how often the thread looks at the children.
    """

    def __init__(self, children: list[subprocess.Popen], rank: int = 0, grace_s: float = 10.0,
                 poll_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="mtraining-local-ranks")  # ends with this process
        self.children = children
        self.rank = rank
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._this_failed = threading.Event()

    def run(self) -> None:
        failed_at = None
        while not self._this_failed.is_set():
            codes = [child.poll() for child in self.children]
            if all(code == 0 for code in codes):
                return  # every child ended well
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.grace_s:
                failed = [i + 1 for i, code in enumerate(codes) if code not in (None, 0)]
                self._say(f"local rank(s) {failed} failed and this process was still running {self.grace_s:.0f} s "
                          "later: ending every process of this node")
                self._kill_children()
                os.kill(os.getpid(), _KILL)
                return
            time.sleep(self.poll_s)

    def end_after_failure(self) -> None:
        """This process failed: give the children ``grace_s`` to end on their own, then kill those left. When this
        process failed first and every other rank has said its one line (Note [The first failure speaks last] in
        :mod:`lightning_mtraining.core.errors`), they have nothing left to say: they are ended at once."""
        self._this_failed.set()  # the thread no longer ends this process: it is ending on its own
        grace = 0.0 if told_the_others_first() else self.grace_s
        deadline = time.monotonic() + grace
        for child in self.children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        running = [i + 1 for i, child in enumerate(self.children) if child.poll() is None]
        if running:
            if grace:  # (told ranks have said why they end)
                self._say(f"local rank(s) {running} still running {grace:.0f} s after this rank failed: ending them")
            self._kill_children()

    def end_if_this_failed(self) -> None:
        """At exit: :meth:`end_after_failure` if this process ends with an uncaught exception."""
        if getattr(sys, "last_value", None) is not None and not self._this_failed.is_set():
            self.end_after_failure()

    def _say(self, message: str) -> None:
        sys.stderr.write(f"[rank{self.rank}]: {message}\n")
        sys.stderr.flush()

    def _kill_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(_KILL)
        for child in self.children:
            try:
                child.wait(timeout=5)  # reap: no zombie left either
            except subprocess.TimeoutExpired:
                pass


class ChecksBeforeLaunch:
    """Mixed into Lightning's launchers: the strategy's checks run in the launching process, before other
    processes start, so a bad configuration gives one short error instead of one traceback per rank."""

    _mtraining_strategy: Any

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._mtraining_strategy.check_before_launch(trainer, alone=True)  # before the processes are spawned
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class CheckedSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher (``devices=N`` from a script) with the strategy's checks before the children
    start, and :class:`LocalRanks` instead of Lightning's watcher (Note [No rank outlives a failure])."""

    grace_s = 10.0

    def __init__(self, strategy: Any, *args: Any) -> None:
        super().__init__(*args)
        self._mtraining_strategy = strategy
        self.local_ranks: LocalRanks | None = None

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Lightning's launch (lightning 2.6), with the checks first and this module's watcher
        starts_others = not self.cluster_environment.creates_processes_externally
        self._mtraining_strategy.check_before_launch(trainer, alone=starts_others)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if starts_others:
            self._call_children_scripts()
            self.local_ranks = LocalRanks(self.procs, self.cluster_environment.global_rank(), self.grace_s)
            self.local_ranks.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except Exception as exception:
            self._mtraining_strategy.record_failure(exception, trainer)  # before the other ranks are waited for
            if self.local_ranks is not None:
                self.local_ranks.end_after_failure()
            raise


class CheckedMultiProcessingLauncher(ChecksBeforeLaunch, _MultiProcessingLauncher):
    """Lightning's spawning launcher with the strategy's checks before the processes start."""

    def __init__(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(strategy, *args, **kwargs)
        self._mtraining_strategy = strategy


class FabricSubprocessScriptLauncher(_FabricSubprocessScriptLauncher):
    """Fabric's subprocess launcher (``Fabric(devices=N)`` from a script) with :class:`LocalRanks` instead of
    Lightning's watcher: a failure inside ``fabric.launch(fn)``, or one that ends the script after
    ``fabric.launch()``, ends the children still running after ``grace_s`` (Note [No rank outlives a failure])."""

    grace_s = 10.0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.local_ranks: LocalRanks | None = None

    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        # Fabric's launch (lightning 2.6), with this module's watcher
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self.local_ranks = LocalRanks(self.procs, self.cluster_environment.global_rank(), self.grace_s)
            self.local_ranks.start()
            atexit.register(self.local_ranks.end_if_this_failed)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except Exception as exception:
            claim_first_failure(exception)  # Note [The first failure speaks last] in lightning_mtraining.core.errors
            if self.local_ranks is not None:
                self.local_ranks.end_after_failure()
            raise
