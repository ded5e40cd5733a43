"""What an adapter declares about one vLLM surface.

An adapter is data, not code paths: it says which Python module or class a binding document
describes, how the documented names map onto the installed vLLM, which entries touch process-wide
state, what extra argument types clients may build (and which of their fields), which members of
the undocumented types that documented calls return a client may reach, and the checks that keep a
client within what the operator allows (`Policy`). The catalog turns these into entries; the invoker
never needs to know which surface an entry came from.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Policy:
    """What the operator allows a worker's clients, beyond the documents (pool config keys, or
    `vllm-bridge worker` options)."""

    collective_rpc_methods: frozenset[str] = frozenset()   # worker methods `collective_rpc` may name
    model_dirs: tuple[str, ...] = ()       # where client-made engines may load models and tokenizers from
    lora_dirs: tuple[str, ...] = ()        # where LoRA adapters may be loaded from (model_dirs too)
    rendezvous_hosts: frozenset[str] = frozenset({"127.0.0.1", "localhost", "::1"})   # process groups meet here
    engine_args_allowed: frozenset[str] = frozenset()   # engine arguments allowed beyond the safe ones
    # Ranks a process group a client sets up may have beyond the pool's own: peers that join from
    # elsewhere, at rendezvous_hosts. None by default: a rank that never comes holds a thread (and
    # the exclusive lane) for torch's 30 minutes, whatever the call's deadline.
    outside_ranks: int = 0
    max_prompt_chars: int = 1_000_000      # a longer prompt, or any longer string, is refused (RESOURCE_EXHAUSTED)
    # Identities that may change a published object for every client (pause or put an engine to
    # sleep, unload its adapters, ...); "*": every caller. None by default: see AdapterSpec.per_client.
    operators: frozenset[str] = frozenset()
    # A request nobody can read (one `add_request` started) is ended this long after it started;
    # 0: it runs to its end (see `Finalizer.expires`).
    unread_request_s: float = 30.0
    # Without authentication, an engine a client made that no call has named for this long, and that
    # has no work in hand, is released (and so shut down); 0: never (see `worker/reclaim.py`).
    idle_engine_s: float = 900.0
    # Without authentication, a ref whose maker's connection has closed, and that no call has used for
    # this long, is released (`worker/reclaim.py`); 0: never. The grace keeps the refs of a client
    # that reconnects and goes on using them: the pool server closes a connection idle for 5 minutes,
    # so a client idle longer than that reconnects, and its refs live on for this long unused.
    orphan_ref_s: float = 3600.0
    # The sequences a published engine holds live, every client's (a host takes at most three quarters
    # of what the other hosts leave, a client the same of its host's); 0: no bound.
    max_live_sequences: int = 12_288
    # How long a new structured-output grammar's trial may take (compiling it and generating under it, in a
    # process that can be stopped: `grammar_check.py`); 0: not tried, the engine takes any grammar but those
    # it ended sequences of (and their clients' for a while).
    grammar_compile_s: float = 5.0

    def operator(self, identity: str) -> bool:
        return "*" in self.operators or (bool(identity) and identity in self.operators)


@dataclass(frozen=True)
class CallContext:
    """What a guard knows of the call besides its arguments."""

    policy: Policy
    identity: str = ""          # the client's identity ("" when the server has no authentication)
    published: bool = False     # the receiver is an object the worker published (shared by every client)
    catalog_names: frozenset[str] = frozenset()   # every name in the catalog
    world_size: int = 1         # the ranks of the worker's pool (1: a pool that is not distributed)
    client: str = ""            # whom fairness goes by: the identity, else the caller's connection
    # Who holds a module's state through context managers in force (`worker/contexts.py`), by the
    # module's file, as the given client asks: the `client` that entered them, "" when none is.
    holder: Callable[[str, str], str] = lambda module_file, who: ""


# Whom the call running now is for (its CallContext.client), for what runs with no guard of its own
# (an exposure's override): the worker sets it around every call it runs, in its thread too.
calling_client: contextvars.ContextVar[str] = contextvars.ContextVar("calling_client", default="")


# A guard runs before the call with the receiver, the bound arguments and the call's context, and
# raises BridgeError to refuse it; it may be a coroutine function (to ask the engine something first).
# It may return a map of arguments whose values the server sets (a request's priority on an engine
# that schedules by fair share), which replace the caller's.
Guard = Callable[[Any, Mapping[str, Any], CallContext], Any]


@dataclass(frozen=True)
class RecordRule:
    """What a client may set when it builds a record class, from a map or through its constructor:
    the fields it may give (None: any), and a check of the values against the operator's policy
    (raises BridgeError). Fields that load code, name classes, reach the network or read files an
    operator did not choose are left out: a record is data, and building one must not run anything."""

    module: str
    attr: str
    fields: frozenset[str] | None = None
    check: Callable[[Mapping[str, Any], Policy], None] | None = None


@dataclass(frozen=True)
class Exposure:
    """Members a client may reach on instances of an undocumented type that documented calls return
    (a tokenizer's `encode` and `decode`, a config's fields): everything else is PERMISSION_DENIED."""

    module: str
    attr: str
    methods: frozenset[str] = frozenset()
    attributes: frozenset[str] = frozenset()    # read only
    fields: bool = False                        # its declared fields (dataclass, struct), read only
    # Methods run as the adapter's function instead (receiver first, the method's own signature),
    # where the method as it is would harm other calls (hold the interpreter's lock for seconds).
    overrides: Mapping[str, Callable[..., Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Constructor:
    """A class clients may build (to pass as an argument) even though no document lists it."""

    name: str            # the public name clients use, e.g. "vllm.SamplingParams"
    module: str          # where to import it from
    attr: str


@dataclass(frozen=True)
class RecordType:
    """A plain class whose instances go by value, as records of these attributes."""

    module: str
    attr: str
    fields: tuple[str, ...]
    constant: tuple[str, ...] = ()   # fields that are the same object in every item of one stream


@dataclass(frozen=True)
class Growing:
    """Fields of a class sent by value (a RecordType, a dataclass) that, through one stream, hold
    one list which only grows: items once in it are never changed, only new ones appended (vLLM's
    cumulative token ids and logprobs). While a field is still that same list, a patch sender
    sends only the new items (and shadows none of them that holds other values), and a stream's
    whole-value encoder encodes only them onto a copy of its last encoding; without the declaration
    each would go over every item again at every step, a cost per item that grows with the
    generation (see `wire/patch.py`)."""

    module: str
    attr: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Finalizer:
    """What must end with the last ref to an instance of a class the adapter's calls hand out (not
    the adapter's own class: that one's is `AdapterSpec.finalizer`): a request's output collector,
    whose request would otherwise run on in the engine with nobody to read it.

    `expires`: refs to such an object go (and `fn` runs) `Policy.unread_request_s` after it was
    handed out, whoever still holds them. For what no client can read (an `add_request` collector has
    no documented member), holding it on is only a cost to everyone else: a stranger's fire-and-forget
    requests kept a shared engine full and busy for minutes after the stranger was gone."""

    module: str
    attr: str
    fn: Callable[[Any], None]
    expires: bool = False


@dataclass(frozen=True)
class Lifecycle:
    """For instances of an adapter's class that can die under the worker (an engine whose core
    process exits or stops answering): how to tell, what to do then, and how to warm one up."""

    # Why the instance can no longer serve, when that is certain (its process exited); else None.
    dead: Callable[[Any], str | None]
    # Whether it answers a round trip within the time given (seconds): one that does not, and makes no
    # progress meanwhile, twice in a row, is dead. Awaited every few seconds.
    answers: Callable[[Any, float], Awaitable[bool]]
    # Makes a dead instance fail fast from now on (its calls, and those in flight, with `cause`) and
    # frees what it holds; it is replaced (published) or left for its refs to be released.
    kill: Callable[[Any, str], None]
    # A short first use, so that no client's call pays what a first use costs (kernel compilation).
    warmup: Callable[[Any], Awaitable[None]] | None = None
    # Called once an instance exists in a worker (before any warm-up): what the library itself does
    # once its own server has started, for the process's sake (it runs whether or not warm-ups do).
    started: Callable[[Any], None] | None = None
    # Whether it has work in hand (an engine's live requests): in use, however long ago a call named it.
    busy: Callable[[Any], bool] | None = None
    # Why it cannot answer now though it lives (its core process stopped by a signal), else None:
    # health says so at once, rather than after the probes that find it silent.
    stopped: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class AdapterSpec:
    surface: str                          # key of the surface JSON in adapters/surfaces/
    module: str                           # the Python module the document describes
    cls: str | None = None                # for class documents: the class inside `module`
    public_name: str | None = None        # catalog prefix; defaults to module(.cls)
    aliases: Mapping[str, str] = field(default_factory=dict)   # documented name -> Python attribute
    exclusive: bool = False               # entries touch process-wide state unless listed in `shared`
    shared: frozenset[str] = frozenset()  # entries that are pure and may run concurrently
    inline: frozenset[str] = frozenset()  # trivial pure functions run on the event loop, no thread hop
    profiles: Mapping[str, str] = field(default_factory=dict)  # per-entry default timeout profile
    result_refs: frozenset[str] = frozenset()   # entries whose result is always returned as a ref
    guards: Mapping[str, Guard] = field(default_factory=dict)    # by entry name; "*": every entry
    # Run this instead: for "new", the constructor; for a method, called with the receiver first.
    overrides: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    finalizer: Callable[[Any], None] | None = None   # when the last ref to an instance of `cls` goes
    finalizers: tuple[Finalizer, ...] = ()           # ... and of the classes here
    lifecycle: Lifecycle | None = None    # instances of `cls` that can die under the worker
    # Entries that communicate with every rank of the process group: in a distributed pool they run
    # only as Collectives (all ranks at once); called on one rank they would wait forever.
    collectives: frozenset[str] = frozenset()
    # Entries that end or tear down what other calls made (a process group's destroy): they free
    # what they touch, so a worker short of open files still runs them (`worker/openfiles.py`).
    frees: frozenset[str] = frozenset()
    # A published instance (an engine the server creates at start) is shared by every client. Of its
    # methods, these any client may call: they act on the caller's own requests, or only read. The
    # others change the instance for everyone (pause it, put it to sleep, reset its caches, unload
    # adapters), and only an operator (Policy.operators) may call them on a published instance; on an
    # instance a client made, its own, everything documented is open to that client.
    per_client: frozenset[str] = frozenset()
    record_rules: tuple[RecordRule, ...] = ()
    exposures: tuple[Exposure, ...] = ()
    constructors: tuple[Constructor, ...] = ()
    records: tuple[RecordType, ...] = ()
    growing: tuple[Growing, ...] = ()

    @property
    def prefix(self) -> str:
        return self.public_name or (f"{self.module}.{self.cls}" if self.cls else self.module)
