"""`tandem serve`: the pod's main process. It starts the engine process and the front processes,
serves the pod's one metrics endpoint from what they report, and decides how the pod ends.

- SIGTERM / SIGINT: every front drains (NOT_SERVING, running streams finish, at most
  `drain_timeout_s`), then the engine stops; exit status 0. Before the model is ready nothing is
  waited for: the load is abandoned. A SIGTERM sent to the whole process group (a service manager,
  `timeout`) does the same: the fronts drain on their own, a serving engine ignores it.
- The engine process dies: the fronts turn NOT_SERVING and end their streams with UNAVAILABLE, and
  the pod exits with status 1, so that Kubernetes restarts it. A front that dies ends the pod too.
- The process that started `tandem serve` ends (a test harness, a script, a tool that was killed):
  the pod stops as on SIGTERM, exit status 0. Not where that process is an init (PID 1, or outside
  the PID namespace, as in a container, where `tandem serve` is PID 1 itself): it outlives the pod.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.process import BaseProcess

import zmq

from .. import contract as c
from ..api_processes import api_processes, engine_on_cuda
from ..cache_dirs import COMPILE_CACHE_UNUSABLE_EXIT
from ..cpus import usable_cores
from ..ipc import sockets
from ..models.prefetch import start_prefetch
from ..server.auth import TokenFile
from ..server.tls import CertificateFiles
from ..settings import ServerSettings
from ..telemetry.http import MetricsServer
from ..telemetry.pod import PodTelemetry
from ..telemetry.startup import process_started_at
from . import entry
from .drained import Drained

log = logging.getLogger("tandem.serve")
STOP_WAIT_S = 10.0  # how long a process that was told to stop may take before it is killed
ENGINE_GONE_WAIT_S = 5.0  # fronts ending their streams after the engine died
RECEIVE_POLL_MS = 200
# the longest a scrape waits for the receiving thread to record what was delivered before it
SCRAPE_CATCH_UP_S = 1.0


def _reserve_port(host: str) -> tuple[socket.socket, int]:
    """A free port, held (bound, not listening) for the pod's life so that all fronts can share it."""
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind((host, 0))
    return holder, holder.getsockname()[1]


class CannotStart(RuntimeError):
    """A setting the pod cannot start with (a port in use, TLS files that do not load): said, exit 1."""


class PortInUse(CannotStart):
    pass


def _check_port_free(host: str, port: int) -> None:
    """Another server already listening on the port would share it with our fronts (they set
    SO_REUSEPORT): fail instead. A socket without SO_REUSEPORT cannot bind a port that is listened on."""
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of an earlier run is fine
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = f"port {port} on {host} is in use ({exc.strerror}): is another server running there?"
            raise PortInUse(why) from exc


def _check_security_files(s: ServerSettings) -> None:
    """Fail before any process starts when the TLS files or the token file would not load."""
    try:
        if s.tls_cert_file is not None and s.tls_key_file is not None:
            CertificateFiles(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
        if s.auth_token_file is not None:
            TokenFile(s.auth_token_file)
    except (OSError, ValueError) as exc:
        raise CannotStart(str(exc)) from exc


def _stop(proc: BaseProcess, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        log.warning("%s did not stop in %.0f s; killing it", proc.name, timeout)
        proc.kill()
        proc.join()


def _watched_parent() -> int | None:
    """The process whose end stops the pod: the one that started it, unless it is an init (PID 1, or 0:
    a parent outside our PID namespace), which never ends before the pod does."""
    parent = os.getppid()
    return None if parent <= 1 else parent


class Supervisor:
    def __init__(self, settings: ServerSettings, log_level: str) -> None:
        self.settings = settings
        self.started_at = process_started_at()  # the start-up's phases count from here
        self.parent = _watched_parent()
        self.log_level = log_level
        self.folder = tempfile.mkdtemp(prefix="tandem-")
        self.endpoints = sockets.Endpoints(self.folder)
        self.telemetry = PodTelemetry(settings)
        self.zmq = zmq.Context()
        self.inbox = sockets.pull(self.zmq, self.endpoints.supervisor)
        self.stop_requested = threading.Event()
        self._closing = threading.Event()
        self._ready_fronts: set[int] = set()
        self._engine_restarted = False  # the engine gets one more start without compiled artefacts
        self._receiver = threading.Thread(target=self._receive, name="tandem-telemetry", daemon=True)
        self.drained = Drained()  # a scrape waits for the receiving thread to catch up
        self.engine: BaseProcess | None = None
        self.fronts: list[BaseProcess] = []
        self.metrics_server: MetricsServer | None = None
        self._port_holder: socket.socket | None = None

    # -- what the engine and fronts report ------------------------------------------------------
    def _receive(self) -> None:
        decoder = c.decoder(c.ToSupervisor)
        replies: dict[int, zmq.Socket] = {}  # to each front that asked something, this thread's own
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.drained.wake, zmq.POLLIN)  # a scrape waiting for this thread
        self.drained.receiving(True)
        try:
            while not self._closing.is_set():
                if not self.inbox.poll(0):
                    self.drained.mark()
                    ready = dict(poller.poll(RECEIVE_POLL_MS))
                    if self.drained.wake.fileno() in ready:  # a plain socket is told by its descriptor
                        self.drained.woken()
                    if self.inbox not in ready:
                        continue
                frame = self.inbox.recv(copy=False)
                try:
                    msg = decoder.decode(frame)
                    if isinstance(msg, c.FrontReady):
                        self._front_ready(msg.front)
                        self._maybe_serving()
                    elif isinstance(msg, c.StatisticsQuery):
                        if msg.front not in replies:
                            replies[msg.front] = sockets.push(self.zmq, self.endpoints.front(msg.front))
                        reply = c.StatisticsReply(msg.query, self.telemetry.statistics.models())
                        replies[msg.front].send(c.encode(reply))
                    else:
                        self.telemetry.record(msg)
                        if isinstance(msg, c.EngineReady):
                            self._maybe_serving()
                except Exception:  # telemetry must never take the pod down, nor stop with one bad message
                    log.exception("a report could not be recorded")
        finally:
            self.drained.receiving(False)
            self.drained.close()
            for sock in replies.values():
                sock.close()
            self.inbox.close()

    def _front_ready(self, front: int) -> None:
        """Once every front could serve, all may say so (on the receiving thread)."""
        self._ready_fronts.add(front)
        if len(self._ready_fronts) == len(self.fronts):
            for i in range(len(self.fronts)):
                to_front = sockets.push(self.zmq, self.endpoints.front(i))
                to_front.send(c.encode(c.PodReady()))
                to_front.close()
            log.info("every front is ready")

    def _start_engine(self, settings: ServerSettings | None = None, started: bool = True) -> None:
        """A new engine process (started, unless the caller starts it beside the fronts)."""
        spawn = multiprocessing.get_context("spawn")  # CUDA and grpc both forbid fork after start-up
        s = settings or self.settings
        self.engine = spawn.Process(
            target=entry.engine,
            args=(s, self.endpoints, s.api_processes, self.log_level, self.started_at),
            name="tandem-engine",
        )
        if started:
            self.engine.start()
            log.info("engine process %d started again", self.engine.pid)

    def _engine_may_start_again(self) -> bool:
        """Once, before it was ready: the engine set its compiled artefacts aside (cache_dirs)."""
        assert self.engine is not None
        if self.engine.exitcode != COMPILE_CACHE_UNUSABLE_EXIT or self.telemetry.engine_ready:
            return False
        if self._engine_restarted:
            return False
        self._engine_restarted = True
        return True

    def _maybe_serving(self) -> None:
        """Once the engine is ready and every front too, the pod serves: say how long it took."""
        if self.telemetry.serving_after_s is not None or not self.telemetry.engine_ready:
            return
        if len(self._ready_fronts) < len(self.fronts):
            return
        self.telemetry.serving_after_s = time.time() - self.started_at
        log.info("serving %.1f s after the process started (%s)", self.telemetry.serving_after_s,
                 self.telemetry.startup.summary())

    def _engine_alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive()

    # -- processes --------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if s.port == 0:
            self._port_holder, port = _reserve_port(s.host)
            s = self.settings = s.model_copy(update={"port": port})
        else:
            _check_port_free(s.host, s.port)
        for extra in (s.health_port, s.http_port):
            if extra:
                _check_port_free(s.host, extra)
        _check_security_files(s)
        if s.prefetch_weights:
            start_prefetch(s.model, s.cache_dir)  # the disk reads overlap the engine's imports
        fronts = api_processes(s)
        if s.api_processes == "auto":
            where = "CUDA" if engine_on_cuda(s.device) else "the CPU"
            log.info("api_processes auto: %d front process(es), the engine on %s, %d cores", fronts, where,
                     usable_cores())  # fmt: skip
        s = self.settings = s.model_copy(update={"api_processes": fronts})
        self._receiver.start()
        if s.metrics_port:
            host = s.metrics_host or s.host
            try:
                self.metrics_server = MetricsServer(
                    host, s.metrics_port, self._engine_alive,
                    before_scrape=lambda: self.drained.wait(SCRAPE_CATCH_UP_S),
                )
            except OSError as exc:
                why = f"the metrics port {s.metrics_port} on {host} is in use ({exc.strerror})"
                raise PortInUse(why) from exc
            self.metrics_server.start()
            log.info("metrics on http://%s:%d/metrics", host, self.metrics_server.port)
        spawn = multiprocessing.get_context("spawn")  # CUDA and grpc both forbid fork after start-up
        self._start_engine(started=False)
        self.fronts = [
            spawn.Process(
                target=entry.front, args=(s, i, self.endpoints, self.log_level), name=f"tandem-front-{i}"
            )
            for i in range(s.api_processes)
        ]
        for proc in (self.engine, *self.fronts):
            proc.start()
        fronts = ", ".join(str(f.pid) for f in self.fronts)
        log.info("engine process %d, front process(es) %s on port %d", self.engine.pid, fronts, s.port)

    def run(self) -> int:
        """Wait for a stop signal or a child's end; return the pod's exit status."""
        assert self.engine is not None
        children = {proc.sentinel: proc for proc in (self.engine, *self.fronts)}
        while not self.stop_requested.is_set():
            if self.parent is not None and os.getppid() != self.parent:
                log.warning("the process that started the server (%d) has ended; stopping", self.parent)
                break
            ended = multiprocessing.connection.wait(list(children), timeout=0.2)
            if not ended:
                continue
            if self.stop_requested.is_set():  # a SIGTERM to the whole process group reached it too
                break
            proc = children[ended[0]]
            proc.join(1.0)  # reaped: its exit code is known
            if proc is self.engine and self._engine_may_start_again():
                del children[ended[0]]
                # without the compiler's cache: this start's artefacts are not kept, the next start's are
                self._start_engine(self.settings.model_copy(update={"compile_cache": False}))
                children[self.engine.sentinel] = self.engine
                continue
            if proc is self.engine:
                return self._engine_died()
            log.error("%s exited with code %s; stopping the pod", proc.name, proc.exitcode)
            self._stop_all()
            return 1
        self._stop_all()
        return 0

    def _stop_all(self) -> None:
        """Drain every front, then stop the engine."""
        for front in self.fronts:
            if front.is_alive():
                front.terminate()  # SIGTERM: the front drains
        for front in self.fronts:
            _stop(front, self.settings.drain_timeout_s + STOP_WAIT_S)
        assert self.engine is not None
        if not self.engine.is_alive():
            return
        if not self.telemetry.engine_ready:
            log.info("stopped before the model was ready; not waiting for the load")
            self.engine.terminate()  # one that turned ready meanwhile ignores it: Shutdown stops that one
        to_engine = sockets.push(self.zmq, self.endpoints.engine)
        to_engine.send(c.encode(c.Shutdown()))
        _stop(self.engine, STOP_WAIT_S)
        to_engine.close()

    def _engine_died(self) -> int:
        assert self.engine is not None
        code = self.engine.exitcode
        reason = f"exit code {code}" if code is not None and code >= 0 else f"killed by signal {-(code or 0)}"
        when = "" if self.telemetry.engine_ready else " before the model was ready"
        log.error("the engine process ended%s (%s); failing its streams and stopping the pod", when, reason)
        for i, front in enumerate(self.fronts):
            if front.is_alive():
                to_front = sockets.push(self.zmq, self.endpoints.front(i))
                to_front.send(c.encode(c.EngineGone(reason)))
                to_front.close()
        for front in self.fronts:
            _stop(front, ENGINE_GONE_WAIT_S)
        return 1

    def close(self) -> None:
        for proc in (*self.fronts, *([self.engine] if self.engine else [])):
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self._closing.set()
        if self._receiver.is_alive():
            self._receiver.join()
        else:
            self.inbox.close()
        self.zmq.term()
        self.telemetry.shutdown()
        if self._port_holder is not None:
            self._port_holder.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def serve(settings: ServerSettings, log_level: str = "INFO") -> int:
    supervisor = Supervisor(settings, log_level)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: supervisor.stop_requested.set())
    try:
        supervisor.start()
        return supervisor.run()
    except CannotStart as exc:
        log.error("%s", exc)
        return 1
    finally:
        supervisor.close()
