"""A warm start for the Python workers: one process per agent imports PyTorch and transformers once,
and every torch or pipeline-stage worker on no GPU is forked from it, where each would otherwise
import them anew (bench/worker_start.py measures both).

    python -m agent.backends.forkserver --socket FD MODULE...     (the agent starts it; never by hand)

A worker forked here gets what `subprocess.Popen` gives one (agent/backends/launch.py): its command
line run as `python -m` runs it (runpy), exactly the environment it was sent, stdout and stderr
appended to its log, stdin from /dev/null, the agent's working directory (the server's: the agent
never changes its own), death with its parent (PR_SET_PDEATHSIG; the server itself dies with the
agent), and its exit status told to the agent (negative: the signal that killed it). The agent
forks only workers given no GPU: CUDA cannot be used in a child forked after its parent touched it,
and the server's own environment hides every GPU from whatever its imports probe.

A fork copies only the thread that forks. The server refuses to fork once a Python thread runs
beside it or CUDA is initialised in it, and says so; the agent then starts workers as before. Native
thread pools (OpenBLAS's, started by importing numpy) carry their own fork handlers, as they must
for multiprocessing's fork.

What siblings share, as children of one process: str hashing's secret, and whatever the server's
memory held, earlier requests included (other workers' credentials: no more than the same user reads
in their /proc/PID/environ). Workers handed decrypted weights are never forked.

Why not multiprocessing's forkserver: it hands each child a copy of its client's liveness pipe, so
its server outlives a killed agent while any child lives (unless each child closed a descriptor
that is multiprocessing's private business), and it runs a pickled callable under multiprocessing's
bootstrap, where a worker here is a command line with its own environment, log and exit status.

The wire, a SOCK_SEQPACKET pair, one JSON message a datagram: the server first says {"ready": true}
(or false, with "why"). Then, for each request {"module", "args", "env"}, sent with two descriptors
(the write end of the child's status pipe, and its log opened for appending), it answers
{"pid": N} with the child's pidfd, or {"error": why}. When a child exits, its status (a signed
32-bit integer) is written to its status pipe, which is then closed; a pipe closed with nothing in
it means the server died, and with it the child (PR_SET_PDEATHSIG: SIGKILL).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import importlib
import json
import os
import runpy
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import trio

READY_TIMEOUT_S = 300.0  # the imports of a cold start on a slow disk
ANSWER_TIMEOUT_S = 30.0  # a fork
MAX_MESSAGE = 1 << 20  # what the server reads of a request, at most (and the agent of an answer)
MAX_REQUEST = 128 << 10  # a command line and an environment; larger: that worker starts as a new process
# (within the sockets' default buffers, net.core.wmem_default, 208 KiB: one datagram must fit)
STATUS = struct.Struct("<i")
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, even by SIGKILL: no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)


def _why_not_fork() -> str | None:
    """Why forking from this process now would hand a child a broken copy of it, or None."""
    if threading.active_count() > 1:
        return f"a Python thread runs beside the fork server ({', '.join(t.name for t in threading.enumerate())})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the fork server"
    return None


def _check(request: Any) -> dict[str, Any]:
    def texts(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    ok = (isinstance(request, dict) and isinstance(request.get("module"), str) and texts(request.get("args"))
          and isinstance(request.get("env"), dict) and all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in request["env"].items()))
    if not ok:
        raise ValueError("a request needs module, args and env")
    return request  # type: ignore[no-any-return]


def _become(request: dict[str, Any], server: int, log: int, close: Sequence[int]) -> None:
    """In the child: everything Popen would have set up, then back to main to run the module."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    die_with_parent()
    if os.getppid() != server:  # the server died before the line above: so must its child
        os._exit(1)
    for fd in close:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    _title([sys.executable, "-m", request["module"], *request["args"]])  # before the environment changes
    os.environ.clear()
    os.environ.update(request["env"])
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # its global generator was seeded once, in the server, for every child
        numpy_random.seed()


def serve(sock: socket.socket, preload: Sequence[str]) -> dict[str, Any] | None:
    """The server's loop: None once the agent has closed its end; in a child just forked, the request
    it is to run."""
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker imports it again itself, and says what is wrong
            pass
    why = _why_not_fork()
    _send(sock, {"ready": why is None, **({"why": why} if why else {})})
    if why is not None:  # at once: a thread an import started may hold a normal exit up for good
        sys.stderr.write(f"fork server: forking nothing: {why}\n")
        sys.stderr.flush()
        os._exit(0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD is not ignored
    signal.set_wakeup_fd(wake_w)
    statuses: dict[int, int] = {}  # child pid -> the write end of its status pipe
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                _reap(statuses)
                continue
            try:
                data, fds, flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 2, socket.MSG_CMSG_CLOEXEC)
            except InterruptedError:
                continue
            if not data:
                return None  # the agent closed its end (or died): the children die with this process
            if len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"error": "a request comes with its status pipe and its log"})
                continue
            status_w, log = fds
            try:
                if flags & socket.MSG_TRUNC:
                    raise ValueError(f"a request over {MAX_MESSAGE} bytes")
                request = _check(json.loads(data))
                why = _why_not_fork()
                if why is not None:
                    raise ValueError(why)
                server = os.getpid()
                pid = os.fork()
            except (ValueError, OSError) as exc:
                os.close(status_w)
                os.close(log)
                _send(sock, {"error": str(exc)})
                continue
            if pid == 0:
                selector.close()
                _become(request, server, log, [sock.detach(), wake_r, wake_w, status_w, *statuses.values()])
                return request
            os.close(log)
            pidfd = os.pidfd_open(pid)
            try:
                _send(sock, {"pid": pid}, [pidfd])
            finally:
                os.close(pidfd)
            statuses[pid] = status_w


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = statuses.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, STATUS.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass  # the agent no longer waits for it
            os.close(fd)


def _title(argv: Sequence[str]) -> None:
    """What `ps` shows of a forked worker: its own command line, where the kernel still has the
    server's (setproctitle, with the [torch] extra; its room is the server's command line, which the
    preload makes long). /proc/PID/environ stays the server's: the worker's own is in its os.environ.
    Called while the environment is still the server's: setproctitle finds the command line's room
    from where the environment starts, and an environment replaced first leaves it none."""
    try:
        import setproctitle
    except ImportError:
        return
    os.environ["SPT_NOENV"] = "1"  # the title takes the command line's room only, never the environment's
    try:
        setproctitle.setproctitle(" ".join(argv))
    finally:
        del os.environ["SPT_NOENV"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.backends.forkserver")
    parser.add_argument("--socket", type=int, required=True, help="the descriptor of this end of the agent's socket pair")
    parser.add_argument("preload", nargs="*", help="modules imported before the first fork")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.socket)
    request = serve(sock, args.preload)
    if request is None:
        return 0
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    return 0


# The agent's side.


class ForkedProcess:
    """A worker forked by the fork server, as the supervisor sees a process (launch.Process): its
    exit status comes down its status pipe; a pipe closed empty means the server died, and the
    kernel's SIGKILL (PR_SET_PDEATHSIG) reaches the worker a moment later, so it has ended only
    once its pidfd says so."""

    def __init__(self, pid: int, pidfd: int, status: int) -> None:
        self.pid, self._pidfd = pid, pidfd
        self._status: int | None = status
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._status is not None:
            try:
                data = os.read(self._status, STATUS.size)
            except BlockingIOError:
                return None
            os.close(self._status)
            self._status = None
            if len(data) == STATUS.size:
                return self._ended(STATUS.unpack(data)[0])
        if select.select([self._pidfd], [], [], 0)[0]:
            return self._ended(-signal.SIGKILL)
        return None

    async def wait(self) -> int:
        while (code := self.poll()) is None:
            # A descriptor of this wait's own: poll() in another task (stop's) may close the pipe.
            fd = os.dup(self._status if self._status is not None else self._pidfd)
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                trio.lowlevel.notify_closing(fd)
                os.close(fd)
        return code

    def abandon(self) -> None:
        """Killed, and nothing of it kept (a launch cancelled once its worker was forked)."""
        self.kill()
        if self._status is not None:
            os.close(self._status)
            self._status = None
        if self.returncode is None:
            self.returncode = -signal.SIGKILL
            os.close(self._pidfd)

    def _ended(self, code: int) -> int:
        self.returncode = code
        os.close(self._pidfd)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # by its pidfd: a pid the server has reaped may be another process's
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The agent's handle on its fork server: started on the first worker it is asked for, which waits
    for its imports (as that worker would have imported them itself), then kept for the agent's
    lifetime. `modules`: the worker modules it forks; `preload`: what it imports first;
    `environment`: its own (the workers', less what each is sent: launch.worker_environment)."""

    def __init__(self, modules: Sequence[str], preload: Sequence[str], log: Path,
                 environment: Mapping[str, str]) -> None:
        self.modules, self.preload, self.log = frozenset(modules), tuple(preload), log
        self.environment = dict(environment)
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.why_not: str | None = None  # why it forks nothing (any more): workers start as before
        self._lock = trio.Lock()

    def forks(self, argv: Sequence[str], env: Mapping[str, str], keep_fds: Sequence[int]) -> bool:
        """Whether a worker started as `argv` could be forked here: one of its modules run by this
        Python, given no GPU (CUDA_VISIBLE_DEVICES empty) and no descriptors to inherit."""
        return (self.why_not is None and not keep_fds and env.get("CUDA_VISIBLE_DEVICES") == ""
                and len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in self.modules)

    async def launch(self, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> ForkedProcess | None:
        """The worker forked, or None when the server cannot (why_not says why) or this request is
        too large for its socket: start it as before."""
        request = json.dumps({"module": argv[2], "args": list(argv[3:]), "env": dict(env)}).encode()
        if len(request) > MAX_REQUEST:
            return None
        async with self._lock:
            if self.sock is None and self.why_not is None:
                await self._start()
            if self.sock is None or self.why_not is not None:
                return None
            out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)  # OSError: as Popen's
            status_r, status_w = os.pipe()
            os.set_blocking(status_r, False)
            try:
                # Shielded: a request sent is answered (within ANSWER_TIMEOUT_S) and its answer read;
                # a launch cancelled between the two would leave a worker that no one supervises, and
                # the next launch reading this one's answer.
                with trio.CancelScope(shield=True):
                    socket.send_fds(self.sock, [request], [status_w, out])
                    answer, fds = await self._receive(ANSWER_TIMEOUT_S)
            except OSError as exc:
                os.close(status_r)
                if exc.errno == errno.EMSGSIZE:  # over this system's socket buffer: this worker alone
                    return None
                self.close(f"the fork server stopped answering: {exc!r}", patience=0)
                return None
            except (ValueError, trio.TooSlowError) as exc:
                os.close(status_r)
                # A server that does not answer as it should is stopped: a late answer would be a
                # worker no one supervises. What it forked dies with it, and is reported killed.
                self.close(f"the fork server stopped answering: {exc!r}", patience=0)
                return None
            finally:
                os.close(status_w)
                os.close(out)
            if "pid" not in answer or len(fds) != 1:
                os.close(status_r)
                for fd in fds:
                    os.close(fd)
                # A refusal: no more forks, and the server is kept for the workers it forked.
                self.why_not = str(answer.get("error") or f"the fork server answered {answer!r}")
                return None
            proc = ForkedProcess(int(answer["pid"]), fds[0], status_r)
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:  # the caller was cancelled while its worker was forked: no one would supervise it
            proc.abandon()
            raise
        return proc

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        env = {**self.environment, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
        try:
            with open(self.log, "ab") as out:
                # From the event loop's thread, as ProcessLauncher.launch starts workers (PR_SET_PDEATHSIG).
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "agent.backends.forkserver", "--socket", str(theirs.fileno()), *self.preload],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                    preexec_fn=die_with_parent, env=env)
        except OSError as exc:
            ours.close()
            self.why_not = f"could not start the fork server: {exc!r}"
            return
        finally:
            theirs.close()
        self.sock = ours
        try:
            hello, _ = await self._receive(READY_TIMEOUT_S)
        except (OSError, ValueError, trio.TooSlowError) as exc:
            self.close(f"the fork server did not start: {exc!r}", patience=0)
            return
        except BaseException:  # cancelled while it imports: dropped, and a later launch starts another
            self._stop(patience=0)
            raise
        if hello.get("ready") is not True:
            self.close(str(hello.get("why") or f"the fork server said {hello!r}"), patience=0)

    async def _receive(self, timeout: float) -> tuple[dict[str, Any], list[int]]:
        assert self.sock is not None
        with trio.fail_after(timeout):
            while True:
                await trio.lowlevel.wait_readable(self.sock)
                try:
                    data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 1, socket.MSG_CMSG_CLOEXEC)
                except BlockingIOError:
                    continue
                break
        try:
            if not data:
                raise ValueError("the fork server closed its end (see its log)")
            answer = json.loads(data)
            if not isinstance(answer, dict):
                raise ValueError(f"the fork server said {answer!r}")
        except ValueError:
            for fd in fds:
                os.close(fd)
            raise
        return answer, fds

    def close(self, why: str = "closed", patience: float = 5.0) -> None:
        """No more forks; the server is stopped (its end of the socket closed, it exits: within
        `patience` seconds, else killed), and the workers it forked die with it."""
        self.why_not = self.why_not or why
        self._stop(patience)

    def _stop(self, patience: float) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(patience)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    sys.exit(main())
