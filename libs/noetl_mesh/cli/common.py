"""What every command shares: the exit codes and the one-line errors, SIGINT/SIGTERM while a command
runs, the common options' help, and the calls to a gateway (its refusals and its absence said alike)."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from ..infra.launching import defer  # a leaf: nothing but contextlib

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
EXIT_TIMEOUT = 3  # noetl run --timeout passed before the execution ended
EXIT_NEEDS_PERSON = 3  # noetl migrate: something could not be translated (listed)
EXIT_UNREACHABLE = 4  # no gateway answers at the URL
EXIT_STACK = 5  # the embedded stack cannot start (e.g. one already runs from that home)
from ..infra.launching import EXIT_PORT_TAKEN  # noqa: E402,F401 - noetl service: its metrics port is another's
EXIT_INTERNAL = 70  # an unexpected error: a bug (one line; --debug shows the traceback)
# a signal ends a command with 128 + its number: 130 for SIGINT, 143 for SIGTERM

GATEWAY_HELP = ("the gateway's URL (default: NOETL_GATEWAY_URL, else the gateway of the `noetl up` running from "
                "--home, else http://127.0.0.1:8082)")
HOME_HELP = "the home of a local `noetl up` whose gateway to use (default: NOETL_HOME, else .noetl)"
DEBUG_HELP = "on an unexpected error, print its traceback"
EXIT_CODES = (f"exit status: {EXIT_OK} success; {EXIT_FAILED} failed (an execution, a check, a refusal of the gateway); "
              f"{EXIT_INVALID} invalid input; {EXIT_TIMEOUT} noetl run --timeout passed; {EXIT_UNREACHABLE} no gateway "
              f"answers at the URL; {EXIT_STACK} the embedded stack cannot start (e.g. one runs from that home "
              f"already); {EXIT_PORT_TAKEN} noetl service: its --metrics-port is taken; {EXIT_INTERNAL} an unexpected error (--debug shows the traceback); 130/143 interrupted "
              "(SIGINT/SIGTERM). See docs/operations.md.")


def fail(message: str, code: int = EXIT_INVALID) -> int:
    """Say what went wrong in one line on stderr; the exit code to return."""
    print(f"noetl: {message}", file=sys.stderr)
    return code


def json_object(text: str | None, option: str, empty: dict | None = None) -> dict | None:
    """``--workload JSON``: the object it holds (``empty`` when not given); ValueError saying why not."""
    import json

    if text is None:
        return empty
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object")
    from ..contracts import refs

    if (at := refs.forged(value)) is not None:  # only the engine writes one (D23)
        raise ValueError(refs.refusal(f"{option} at {refs.shown(at) or 'its top'}"))
    return value


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("noetl-mesh")
    except PackageNotFoundError:
        return "unknown (not installed)"


def env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        return default  # reported where it is used: argparse checks --metrics-port, not the variable


# ------------------------------------------------------------------------------- signals and the event loop
class Interrupted(BaseException):
    """SIGINT or SIGTERM ended a command (:class:`Signals`); what it started is stopped first."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """SIGINT and SIGTERM while a command runs what it must stop again (NATS, Postgres, services).
    In plain code they raise :class:`Interrupted` at once (a half-started server is stopped by its own
    ``start``); while :func:`arun` runs a coroutine they cancel it, so that its ``finally`` blocks stop
    what it started, and :func:`arun` raises :class:`Interrupted` after. A second signal is ignored
    while that cleanup runs; a third ends the process at once (what it started may be left running)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.task: asyncio.Task | None = None  # noqa: F821 - asyncio is imported when a coroutine runs
        self.loop: asyncio.AbstractEventLoop | None = None  # noqa: F821
        self._previous: dict[int, object] = {}
        self._arrived: asyncio.Event | None = None  # noqa: F821

    def __enter__(self) -> "Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored on purpose (a shell's background job)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    async def wait(self) -> None:
        """Until a signal arrives, then ``CancelledError``: at once when one arrived before. The
        cancellation a signal causes can be lost on its way (Python 3.11's ``asyncio.wait_for``, under
        the NATS client's requests, returns a reply that arrives with it instead of raising): a command
        that waits for a signal, having started things, still stops."""
        import asyncio

        if self._arrived is None:
            self._arrived = asyncio.Event()
        if self.received is None:
            await self._arrived.wait()
        raise asyncio.CancelledError

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:  # stopping already: the next one is the default's (death)
            signal.signal(signum, signal.SIG_DFL)
            return
        self.received = signum
        if self.task is not None and self.loop is not None and not self.task.done():
            self.task.cancel()
            if self._arrived is not None:
                self.loop.call_soon_threadsafe(self._arrived.set)
            self.loop.call_soon_threadsafe(lambda: None)  # wake the loop up
            return
        if not defer(Interrupted(signum)):  # a server's launch under way raises it once it holds the process
            raise Interrupted(signum)


def run_loop(coro):
    """Run ``coro`` to completion on uvloop when it is installed (a dependency on Linux and macOS: its
    event loop and socket transports cost a service about a fifth less CPU, docs/performance.md), on
    asyncio's own loop otherwise or with ``NOETL_EVENT_LOOP=asyncio``."""
    import asyncio

    factory = None
    if os.environ.get("NOETL_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def arun(coro, signals: Signals):
    """``asyncio.run(coro)`` with ``signals`` cancelling it; Interrupted when a signal did."""
    import asyncio

    async def main():
        signals.task, signals.loop = asyncio.current_task(), asyncio.get_running_loop()
        try:
            return await coro
        finally:
            signals.task = signals.loop = None

    try:
        result = run_loop(main())
    except asyncio.CancelledError:
        if signals.received is not None:
            raise Interrupted(signals.received) from None
        raise
    if signals.received is not None:  # it ended on its own as the signal arrived
        raise Interrupted(signals.received)
    return result


# ------------------------------------------------------------------------------- a gateway
def gateway_option(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--gateway URL`` on a command that talks to a gateway (resolved after parsing: NOETL_GATEWAY_URL,
    the running ``noetl up``'s, 127.0.0.1:8082); the parser, to chain."""
    p.add_argument("--gateway", default=None, metavar="URL", help=GATEWAY_HELP)
    return p


def bad_url(url: str | None) -> str | None:
    """Why ``--gateway URL`` cannot be a gateway's URL (None when it can be)."""
    if not url:
        return None
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        return f"--gateway {url}: not a valid URL ({exc})"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return f"--gateway {url}: not an http:// or https:// URL with a host"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return f"--gateway {url}: the port is not between 1 and 65535"
    return None


# the gateway a command fell back to when neither --gateway, NOETL_GATEWAY_URL nor a running noetl up
# named one, and the home it looked in (main sets it; unreachable says where to look instead)
FALLBACK: dict[str, str | None] = {"gateway": None, "home": None}


def unreachable(gateway: str, exc: BaseException, more: str = "") -> int:
    """One line for a gateway that does not answer (nothing listens, a wrong URL, a timeout). A closed
    standard output (``noetl events ID | head -1``) is not the gateway's doing: it ends quietly (main)."""
    if isinstance(exc, BrokenPipeError):
        raise exc
    reason = str(exc) or type(exc).__name__
    from ..infra import tls

    if tls.is_verify_failure(exc):  # one line: where, why, and which setting
        return fail(f"the gateway at {gateway}: {tls.verify_failure(exc, os.environ.get(tls.GATEWAY_CA), tls.GATEWAY_CA)}"
                    f"{more}", EXIT_UNREACHABLE)
    if gateway == FALLBACK["gateway"] and FALLBACK["home"] and not more:  # nothing told it where to look
        more = (f"; no noetl up runs from {FALLBACK['home']}: start one there (noetl up), or point at one with "
                "--home DIR, NOETL_HOME=DIR or --gateway URL")
    return fail(f"cannot reach the gateway at {gateway} ({reason}){more}", EXIT_UNREACHABLE)


def gateway_failed(exc, gateway: str) -> int:
    if exc.status == 401:
        return fail(f"{exc}\n  log in with `noetl login --gateway {gateway}` (or set NOETL_TOKEN)", EXIT_FAILED)
    return fail(str(exc), EXIT_FAILED)


def gateway_run(gateway: str, work) -> int:
    """``asyncio.run(work())``, which talks to the gateway at ``gateway``: its exit code, or the gateway's
    refusal (exit 1) or absence (exit 4) in one line."""
    import asyncio

    import httpx

    from ..client import GatewayError

    try:
        return asyncio.run(work())
    except GatewayError as exc:
        return gateway_failed(exc, gateway)
    except (OSError, httpx.TransportError) as exc:  # e.g. no gateway listening
        return unreachable(gateway, exc)


def gateway_call(args: argparse.Namespace, fn, columns=None) -> int:
    """The gateway's answer to ``fn(client)`` through the output layer (``-o``; ``columns`` of a table)."""
    from ..client import GatewayClient
    from .output import emit

    async def main() -> int:
        async with GatewayClient(args.gateway) as client:
            emit(await fn(client), getattr(args, "output", None), columns)
            return EXIT_OK

    return gateway_run(args.gateway, main)
