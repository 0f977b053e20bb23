"""Pydantic models of the canonical v10 playbook (docs/dsl.md: D1-D5, D27, D28).

The models are the one description of the document's shape: the validator checks each piece of a
raw document against them (so every error keeps its own location), ``noetl schema`` exports them as
JSON Schema, and the rest of the engine reads the typed, normalised :class:`Playbook`.

Structural objects forbid unknown keys (D1: unknown keys are errors). ``spec`` objects allow extra
keys, because playbooks keep placeholders there; the validator warns about the ones it does not know.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from .. import limits
from ..contracts.subjects import pool_problem
from .durations import is_template, parse_duration, parse_instant
from .paths import path_problem

# D6: names that templates reserve; no step or task may use them.
RESERVED_NAMES = frozenset(
    "workload ctx iter args execution_id keychain event outcome output _prev _task _attempt".split()
)

Template = str  # a string that may hold Jinja2 templates (D6, D7)


def _duration(value: Any) -> Any:
    """D29: a literal duration is checked here (before anything runs); a templated one when rendered."""
    if not is_template(value):
        parse_duration(value, maximum=limits.current().max_timer_seconds)
    return value


def _at_most(name: str):
    """A literal count checked against engine limit ``name`` (docs/limits.md) when the playbook is validated."""
    def check(value: Any) -> Any:
        if isinstance(value, int) and (over := limits.exceeded(name, value)) is not None:
            raise ValueError(str(over))
        return value
    return check


def _instant(value: Any) -> Any:
    if not is_template(value):
        parse_instant(value)
    return value


def _catalog_path(value: str) -> str:
    problem = path_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _pool(value: str) -> str:
    problem = pool_problem(value)
    if problem is not None:
        raise ValueError(f"{problem} (D5)")
    return value


Duration = Annotated[Union[float, str], AfterValidator(_duration)]  # seconds, "5s", "2h", "PT5M" (D29)
Instant = Annotated[str, AfterValidator(_instant)]  # ISO-8601 with a time zone
CatalogPath = Annotated[str, AfterValidator(_catalog_path)]  # lang/paths.py: what names a catalog entry
Pool = Annotated[str, AfterValidator(_pool)]  # a worker pool's name (spec.pool, D5)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Open(BaseModel):
    """A ``spec`` mapping: known keys typed, unknown keys kept (the validator warns about them)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


# ---------------------------------------------------------------- task policy (D9)
class RuleAction(Strict):
    do: Literal["continue", "retry", "jump", "break", "fail"] = "continue"
    attempts: Annotated[int | None, AfterValidator(_at_most("max_task_attempts"))] = Field(
        None, ge=1, description="retry: total attempts, the first included")
    backoff: Literal["none", "linear", "exponential"] = "none"
    delay: float | Template = 0.0
    max_delay: float = Field(60.0, ge=0)
    jitter: bool = False
    to: str | None = Field(None, description="jump: a task label of the same pipeline")
    set_iter: dict[str, Any] | None = None
    set_ctx: dict[str, Any] | None = None


class WhenRule(Strict):
    when: Template
    then: RuleAction


class ElseBody(Strict):
    then: RuleAction


class ElseRule(Strict):
    else_: ElseBody = Field(alias="else")


def _rule_tag(value: Any) -> str:
    return "else" if isinstance(value, dict) and "else" in value else "when"


Rule = Annotated[Union[Annotated[WhenRule, Tag("when")], Annotated[ElseRule, Tag("else")]], Discriminator(_rule_tag)]


class TaskPolicy(Open):
    rules: list[Rule]


class TaskSpec(Open):
    policy: TaskPolicy | None = None
    timeout: float | dict[str, float] | None = None


# ---------------------------------------------------------------- tools (D8, D25, D27, D28)
class TaskBase(Strict):
    name: str | None = None
    desc: str | None = None
    spec: TaskSpec | None = None


class NoopTask(TaskBase):
    kind: Literal["noop"]
    result: Any = None


class HttpTask(TaskBase):
    kind: Literal["http"]
    method: str = "GET"
    url: Template = Field(validation_alias=AliasChoices("url", "endpoint"))
    params: dict[str, Any] | Template | None = None
    headers: dict[str, Any] | Template | None = None
    json_: Any = Field(None, alias="json")
    body: Any = Field(None, validation_alias=AliasChoices("body", "data"))
    timeout: float | dict[str, float] | Template | None = None
    auth: Any = None
    verify: bool | Template = True  # false: the server's certificate is not checked
    follow_redirects: bool | Template | None = None  # default: followed


class PythonTask(TaskBase):
    kind: Literal["python"]
    code: str
    args: dict[str, Any] | Template | None = Field(None, validation_alias=AliasChoices("args", "input"))


class DuckdbTask(TaskBase):
    kind: Literal["duckdb"]
    command: str = Field(validation_alias=AliasChoices("command", "query"))
    params: list[Any] | dict[str, Any] | Template | None = None
    db_path: Template | None = None


class PostgresTask(TaskBase):
    kind: Literal["postgres"]
    command: str = Field(validation_alias=AliasChoices("command", "query"))
    params: list[Any] | dict[str, Any] | Template | None = None
    auth: str | None = Field(None, description="a keychain entry or stored credential name")
    dsn: Template | None = Field(None, description="a connection string, usually from the keychain")


class ShellTask(TaskBase):
    """D33: commands run by a shell in the task sandbox."""

    kind: Literal["shell"]
    command: str | list[str] | Template | None = Field(None, description="a command, or a list run in order")
    cmds: list[str] | Template | None = Field(None, description="commands run in order (alias of a list command)")
    env: dict[str, Any] | Template | None = Field(None, description="the commands' environment variables")
    shell: str | None = Field(None, description="sh, bash (default, when installed) or an absolute path")

    @model_validator(mode="after")
    def _one_of(self) -> "ShellTask":
        given = [k for k in ("command", "cmds") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a shell task takes exactly one of 'command' or 'cmds'"
                             + (", got both" if len(given) == 2 else ""))
        return self


class NatsTask(TaskBase):
    kind: Literal["nats"]
    operation: Template = Field(description="publish, request, js_publish, kv_get, kv_put, kv_delete, kv_keys, "
                                            "object_get, object_put, object_delete")
    url: Any = Field(None, validation_alias=AliasChoices("url", "servers", "server"))
    auth: str | None = Field(None, description="a keychain entry with the credentials (and maybe the url)")
    subject: Template | None = None
    data: Any = Field(None, validation_alias=AliasChoices("data", "payload"))
    value: Any = None
    headers: dict[str, Any] | Template | None = None
    bucket: Template | None = None
    key: Template | None = None
    stream: Template | None = None
    pattern: Template | None = Field(None, description="kv_keys: a glob the keys must match")
    encoding: Template | None = Field(None, description="json (default), text or base64")
    timeout: float | Template | None = None

    @model_validator(mode="after")
    def _known(self) -> "NatsTask":
        from ..tools.nats import ENCODINGS, OPERATIONS

        for name, known in (("operation", OPERATIONS), ("encoding", ENCODINGS)):
            value = getattr(self, name)
            if isinstance(value, str) and "{" not in value and value not in known:
                raise ValueError(f"{name} {value[:60]!r} is not one of {', '.join(known)}")
        return self


class PlaybookTask(TaskBase):
    kind: Literal["playbook"]
    path: Template
    version: int | str | None = None
    workload: dict[str, Any] | Template | None = None
    args: dict[str, Any] | Template | None = Field(None, validation_alias=AliasChoices("args", "input"))


class WorkbookTask(TaskBase):
    kind: Literal["workbook"]
    task: str | None = Field(None, description="the workbook task to run; defaults to this task's name")
    args: dict[str, Any] | Template | None = Field(
        None, validation_alias=AliasChoices("args", "input", "with")
    )


class SecretsTask(TaskBase):
    kind: Literal["secrets"]
    secret: Template = Field(validation_alias=AliasChoices("secret", "key"))
    provider: str | None = None


class WaitTask(TaskBase):
    """D29 (b), D30: wait durably for a time, an instant, or a signal; holds no worker while it waits."""

    kind: Literal["wait"]
    duration: Duration | None = None
    until: Instant | None = None
    signal: Template | None = Field(None, description="the signal's name (D30)")
    timeout: Duration | None = Field(None, description="signal: give up after this long (error kind timeout)")
    roles: list[str] | None = Field(None, description="signal: the roles that may send it")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="signal: JSON Schema of the payload")
    assignee: Any = None
    form: Any = None

    @model_validator(mode="after")
    def _one_of(self) -> "WaitTask":
        given = [k for k in ("duration", "until", "signal") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a wait task takes exactly one of 'duration', 'until' or 'signal'"
                             + (f", got {' and '.join(given)}" if given else ""))
        if self.signal is None:
            extra = [k for k in ("timeout", "roles", "schema_", "assignee", "form") if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"{', '.join(k.rstrip('_') for k in extra)}: only for a wait on a 'signal'")
        if self.schema_ is not None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError
            try:
                Draft202012Validator.check_schema(self.schema_)
            except SchemaError as e:
                raise ValueError(f"schema is not a valid JSON Schema: {e.message}") from None
        return self


Task = Annotated[
    Union[NoopTask, HttpTask, PythonTask, DuckdbTask, PostgresTask, ShellTask, PlaybookTask, WorkbookTask,
          SecretsTask, WaitTask,
          NatsTask],
    Field(discriminator="kind"),
]
TASK_MODELS: dict[str, type[TaskBase]] = {
    m.model_fields["kind"].annotation.__args__[0]: m  # type: ignore[union-attr]
    for m in (NoopTask, HttpTask, PythonTask, DuckdbTask, PostgresTask, ShellTask, PlaybookTask, WorkbookTask,
              SecretsTask, WaitTask,
              NatsTask)
}
TOOL_KINDS = tuple(TASK_MODELS)

# D5: the innermost-but-one layer of every task's effective spec.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "http": {"timeout": 30.0},
    "python": {"timeout": 60.0},
    "postgres": {"timeout": 60.0},
    "duckdb": {"timeout": 60.0},
    "shell": {"timeout": 60.0},
    "nats": {"timeout": 30.0},
}


# ---------------------------------------------------------------- step admission (D17)
class AdmitThen(Strict):
    allow: bool | Template = True


class AdmitWhen(Strict):
    when: Template
    then: AdmitThen


class AdmitElseBody(Strict):
    then: AdmitThen


class AdmitElse(Strict):
    else_: AdmitElseBody = Field(alias="else")


AdmitRule = Annotated[
    Union[Annotated[AdmitWhen, Tag("when")], Annotated[AdmitElse, Tag("else")]], Discriminator(_rule_tag)
]


class AdmitPolicy(Open):
    mode: Literal["exclusive", "inclusive"] = "exclusive"
    rules: list[AdmitRule] = []


class FailurePolicy(Open):
    mode: Literal["fail_fast", "best_effort"] = "fail_fast"


class Lifecycle(Open):
    timeout_s: Duration | None = Field(None, description="D29 (c): a step run fails with error kind timeout after this")


class StepPolicy(Open):
    admit: AdmitPolicy | None = None
    failure: FailurePolicy | None = None
    lifecycle: Lifecycle | None = None
    emit: dict[str, Any] | None = None


class StepSpec(Open):
    policy: StepPolicy | None = None
    join: Literal["all", "any"] = "all"
    max_steps: Annotated[int, AfterValidator(_at_most("max_task_visits"))] = Field(10_000, ge=1)
    pool: Pool | None = Field(None, description="worker pool that runs this step's commands")


# ---------------------------------------------------------------- loop (D19)
class LoopSpec(Open):
    mode: Literal["sequential", "parallel"] = "sequential"
    max_in_flight: int = Field(16, ge=1)
    policy: dict[str, Any] | None = None
    pool: Pool | None = Field(None, description="worker pool that runs the loop's commands")


class Loop(Strict):
    in_: Template | list[Any] = Field(alias="in")
    iterator: str
    spec: LoopSpec | None = None


# ---------------------------------------------------------------- routing (D13, D14)
class ArcSpec(Open):
    delay: Duration | None = Field(None, description="D29 (a): the token is enqueued after this long")


class Arc(Strict):
    step: str
    when: Template | None = None
    args: dict[str, Any] | None = None
    spec: ArcSpec | None = None


class RouterSpec(Open):
    mode: Literal["exclusive", "inclusive"] = "exclusive"
    policy: dict[str, Any] | None = None
    delay: Duration | None = Field(None, description="D29 (a): every arc's delay, unless the arc sets its own")


class Router(Strict):
    spec: RouterSpec | None = None
    arcs: list[Arc] = Field(min_length=1)


class Step(Strict):
    step: str
    desc: str | None = None
    spec: StepSpec | None = None
    loop: Loop | None = None
    tool: list[Task] | Task | None = None
    next: Router | None = None


# ---------------------------------------------------------------- root (D2)
class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    path: CatalogPath = Field(description="the catalog path (segments of letters, digits, _ - . separated by /)")
    version: int | str | None = None
    description: str | None = None


class LimitsPolicy(Open):
    max_payload_bytes: int = Field(256 * 1024, ge=1024)
    max_depth: int | None = Field(None, ge=0, description="how deep child executions (playbook tasks) may nest; default 10")


class ExecutorPolicy(Open):
    limits: LimitsPolicy | None = None


class ExecutorSpec(Open):
    entry_step: str | None = None
    policy: ExecutorPolicy | None = None
    max_steps: Annotated[int | None, AfterValidator(_at_most("max_task_visits"))] = Field(None, ge=1)
    pool: Pool | None = Field(None, description="worker pool of every step that names none")


class Executor(Strict):
    profile: str | None = None
    version: str | None = None
    spec: ExecutorSpec | None = None


class KeychainEntry(BaseModel):
    """A named secret source (D24). A ``static`` entry's other keys are its fields; the other kinds
    have only the fields below."""

    model_config = ConfigDict(extra="allow")
    name: str
    kind: Literal["credential", "static", "env"]
    credential: str | None = None  # credential: the stored credential's name (default: the entry's name)
    var: str | None = None  # env: the environment variable (default: the entry's name)

    @property
    def unknown_keys(self) -> list[str]:
        return [] if self.kind == "static" else list(self.model_extra or {})


class Playbook(Strict):
    apiVersion: Literal["noetl.io/v2"]
    kind: Literal["Playbook"]
    metadata: Metadata
    executor: Executor | None = None
    workload: dict[str, Any] = {}
    keychain: list[KeychainEntry] = []
    workbook: list[Task] | None = None
    workflow: list[Step] = Field(min_length=1)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the playbook language, for editors (``noetl schema``).

    Field aliases (``endpoint`` for ``url``, ``input`` for ``args``...) are added as properties too,
    so a playbook that uses them still validates in an editor.
    """
    schema = Playbook.model_json_schema(by_alias=True)
    for model in _all_models():
        props = schema.get("$defs", {}).get(model.__name__, {}).get("properties")
        if props is None:
            continue
        for field in model.model_fields.values():
            if isinstance(field.validation_alias, AliasChoices):
                names = [c for c in field.validation_alias.choices if isinstance(c, str)]
                for alias in names[1:]:
                    props.setdefault(alias, props.get(names[0], {}))
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "NoETL playbook (canonical v10)"
    return schema


def _all_models() -> list[type[BaseModel]]:
    return [v for v in globals().values() if isinstance(v, type) and issubclass(v, BaseModel) and v.__module__ == __name__]
