"""Every span and attribute name agl reads or writes (DESIGN §4): the only place they are spelled.

OpenTelemetry GenAI semantic conventions are used wherever one exists, so agl traces open in any OTel
backend; agl's own names live under ``agl.``. Import the constants; never type a span name as a
string literal elsewhere.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------ span names
# GenAI operation names double as span names: a span's name is the operation it performs.
SPAN_CHAT = "chat"
SPAN_EXECUTE_TOOL = "execute_tool"
SPAN_INVOKE_AGENT = "invoke_agent"
SPAN_REWARD = "agl.reward"
SPAN_MESSAGE = "agl.message"
SPAN_OBJECT = "agl.object"
SPAN_EXCEPTION = "agl.exception"
SPAN_HANDOFF = "agl.handoff"
SPAN_GUARDRAIL = "agl.guardrail"
SPAN_ROLLOUT = "agl.rollout"
SPAN_PROMPT = "agl.prompt"  # an agent read a prompt template (agl.prompt): which version it ran with

# ----------------------------------------------------------------------- GenAI semantic conventions
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_AGENT_ID = "gen_ai.agent.id"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"  # JSON string: the request messages
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"  # JSON string: the response message(s)
GEN_AI_TOOL_DEFINITIONS = "gen_ai.tool.definitions"  # JSON string: tools offered to the model
ERROR_TYPE = "error.type"  # OTel semconv: the exception class (or error code) of a failed operation

OP_CHAT = SPAN_CHAT
OP_EXECUTE_TOOL = SPAN_EXECUTE_TOOL
OP_INVOKE_AGENT = SPAN_INVOKE_AGENT
OP_TEXT_COMPLETION = "text_completion"  # GenAI semconv: legacy completions API calls
OP_GENERATE_CONTENT = "generate_content"  # GenAI semconv: multimodal generation calls
EVENT_EXCEPTION = "exception"  # OTel: the event Span.record_exception adds

# ------------------------------------------------------------------------------------ agl's own
AGL_ROLLOUT_ID = "agl.rollout.id"
AGL_ATTEMPT = "agl.attempt"
AGL_SIDE = "agl.side"  # "client" (integration) or "server" (gateway) for chat spans
SIDE_CLIENT = "client"
SIDE_SERVER = "server"
AGL_INTEGRATION = "agl.integration"  # which integration made the span (langchain, openai, ...)

AGL_LLM_PROMPT_TOKEN_IDS = "agl.llm.prompt_token_ids"
AGL_LLM_RESPONSE_TOKEN_IDS = "agl.llm.response_token_ids"
AGL_LLM_RESPONSE_LOGPROBS = "agl.llm.response_logprobs"
AGL_LLM_WEIGHT_VERSION = "agl.llm.weight_version"  # the oldest weights that served the call
# the weights that drew the response tokens, run-length and flattened (an attribute holds no nested
# list): [version, n_tokens, version, n_tokens, ...] in token order; two runs or more when the weights
# were swapped during the call (the transformers backend swaps between decode steps)
AGL_LLM_WEIGHT_VERSIONS = "agl.llm.weight_versions"
# the named LoRA adapter that served the call (an adapter per agent); BASE_ADAPTER: the base model did,
# on a backend that serves adapters. Absent on a backend without named adapters.
AGL_LLM_ADAPTER = "agl.llm.adapter"
BASE_ADAPTER = "__base__"
# the agent that made the call, as the request's W3C baggage (``agl.agent``) named it: recorded on every
# backend, with or without named adapters
AGL_LLM_AGENT = "agl.llm.agent"
AGL_LLM_BACKEND = "agl.llm.backend"
AGL_LLM_API = "agl.llm.api"  # the gateway route a call came in by: chat, completions, responses, messages
AGL_LLM_EXACT = "agl.llm.exact"  # False when token ids were re-derived rather than taken from the engine
AGL_LLM_PREFIX_MATCH = "agl.llm.prefix_match"  # multi-turn drift: earlier turn re-rendered identically
AGL_LLM_CHOICE_INDEX = "agl.llm.choice_index"  # for n>1: which choice this span's response ids are
# int: the last N prompt ids are the tool-call opening the backend forced to honour tool_choice
AGL_LLM_FORCED_TOKENS = "agl.llm.forced_tokens"
# int, set when > 0: tool-call blocks the parser repaired (the model wrote on after a call's closing brace,
# or several calls in one block): their calls kept, the rest kept as content (agl.chat.format.parse_reply)
AGL_LLM_TOOL_CALL_REPAIRS = "agl.llm.tool_call_repairs"
AGL_LLM_PROMPT_TEXT = "agl.llm.prompt_text"  # /v1/completions: the raw prompt (no chat template applied)
# reproducible runs (agl.gateway.seeds): the seed the call was sampled with, and where it came from: "run" (derived
# by the gateway from the rollout's seed and the call's index in its attempt) or "agent" (the program set
# ``seed`` itself, which wins); the call's 0-based index within its rollout attempt
AGL_LLM_SEED = "agl.llm.seed"
AGL_LLM_SEED_SOURCE = "agl.llm.seed_source"
AGL_LLM_CALL_INDEX = "agl.llm.call_index"
SEED_SOURCE_RUN = "run"
SEED_SOURCE_AGENT = "agent"
# rollout metadata the trainer writes (agl.gateway.seeds): the rollout's seed, derived from the run's seed and its
# place in the run, and that place ("<mode>:s<step>[r<round>]/t<task position>/m<group member>")
ROLLOUT_SEED_KEY = "agl.seed"
ROLLOUT_PLACE_KEY = "agl.place"
# a held-out rollout decoded greedily (LoopConfig.val_samples=0): the temperature every call of the rollout is
# decoded at, whatever the request asked (the gateway forces it and records the source on the span)
ROLLOUT_TEMPERATURE_KEY = "agl.temperature"
AGL_LLM_TEMPERATURE_SOURCE = "agl.llm.temperature_source"
TEMPERATURE_SOURCE_ROLLOUT = "rollout"
# branching at a call (agl.trainer.branching, agl.gateway.replay): a branch rollout's metadata names its
# parent rollout, the parent's attempt, the branch call's index in it, the agent and the branch member;
# the gateway replays the parent's calls before that index (their spans carry ``agl.llm.replayed``) and
# samples the branch call afresh (``agl.llm.branch_point``); a branch group's id carries BRANCH_GROUP_MARK
ROLLOUT_BRANCH_KEY = "agl.branch"
AGL_LLM_REPLAYED = "agl.llm.replayed"
AGL_LLM_BRANCH_POINT = "agl.llm.branch_point"
BRANCH_GROUP_MARK = ":branch:"

AGL_REWARD_VALUE = "agl.reward.value"
AGL_REWARD_NAME = "agl.reward.name"
AGL_REWARD_PRIMARY = "agl.reward.primary"
AGL_REWARD_SOURCE = "agl.reward.source"  # "emit", "return" (agent's return value), "air"

AGL_MESSAGE_BODY = "agl.message.body"
AGL_OBJECT_JSON = "agl.object.json"
AGL_EXCEPTION_TYPE = "exception.type"  # OTel semconv
AGL_EXCEPTION_MESSAGE = "exception.message"  # OTel semconv
AGL_EXCEPTION_STACKTRACE = "exception.stacktrace"  # OTel semconv
# an agl.exception span the agent marked as an infrastructure failure (emit_exception(..., infra=True))
AGL_EXCEPTION_INFRA = "agl.exception.infra"

# agl.prompt spans (agl.tracing.prompts): the prompt an agent used and where it came from
AGL_PROMPT_NAME = "agl.prompt.name"
AGL_PROMPT_VERSION = "agl.prompt.version"  # content hash (agl.tracing.prompts.prompt_version)
AGL_PROMPT_SOURCE = "agl.prompt.source"  # "resources" (published snapshot) or "default" (the agent's own)
AGL_PROMPT_TEMPLATE = "agl.prompt.template"  # the template text
AGL_PROMPT_ENGINE = "agl.prompt.engine"  # "f-string" | "jinja"
AGL_RESOURCES_VERSION = "agl.resources.version"  # the resources snapshot the rollout ran with

AGL_HANDOFF_FROM = "agl.handoff.from"
AGL_HANDOFF_TO = "agl.handoff.to"
AGL_GUARDRAIL_NAME = "agl.guardrail.name"
AGL_GUARDRAIL_TRIGGERED = "agl.guardrail.triggered"  # bool: the guardrail's tripwire fired
# an agent's calls whose output the app threw away (agl.adapter: left out of training unless
# Adapter(keep_discarded=True), then Transition.discarded): on an invoke_agent span, the windows
# [start_ns, end_ns, start_ns, end_ns, ...] in which its LLM calls started, and why ("input_guardrail": an
# input guardrail tripped while the agent's turn ran, so the SDK discarded the turn's reply)
AGL_DISCARDED_WINDOWS = "agl.discarded.windows"
AGL_DISCARDED_REASON = "agl.discarded.reason"
DISCARDED_INPUT_GUARDRAIL = "input_guardrail"

# LangChain / LangGraph integration: where an agent span came from
AGL_LANGCHAIN_RUN_ID = "agl.langchain.run_id"  # the LangChain run id (joins with LangSmith traces)
AGL_LANGGRAPH_NODE = "agl.langgraph.node"  # the LangGraph node an invoke_agent span is a turn of
AGL_LANGGRAPH_STEP = "agl.langgraph.step"  # int: the graph super-step that ran the node

# CrewAI integration: the crew kickoff and task spans that agent spans nest in
SPAN_CREW = "agl.crew"  # one Crew.kickoff (its tasks are children)
SPAN_TASK = "agl.task"  # one Task of a crew (the agent executing it is a child)
AGL_CREW_NAME = "agl.crew.name"
AGL_CREW_PROCESS = "agl.crew.process"  # "sequential" | "hierarchical"
AGL_TASK_ID = "agl.task.id"
AGL_TASK_NAME = "agl.task.name"
# bool on an execute_tool span: the tool failed and the framework itself ran the same call again; the
# last attempt carries the call's outcome (so one failing call is one ERROR, however often retried)
AGL_TOOL_RETRIED = "agl.tool.retried"

# the name exactly as the framework gave it, when agl's normalisation (agl.names: whitespace trimmed)
# changed it: CrewAI's YAML ``role: >`` leaves a trailing newline in ``Agent.role``
AGL_AGENT_NAME_RAW = "agl.agent.name.raw"
AGL_TOOL_NAME_RAW = "agl.tool.name.raw"
AGL_TASK_NAME_RAW = "agl.task.name.raw"

# ------------------------------------------------------------------------------------- baggage/http
BAGGAGE_ROLLOUT_ID = AGL_ROLLOUT_ID
BAGGAGE_ATTEMPT = AGL_ATTEMPT
# the agent making the call (set by agl.agent(...) spans and the integrations): the gateway serves the
# call with that agent's adapter when it has one
BAGGAGE_AGENT = "agl.agent"
HEADER_TRACEPARENT = "traceparent"
HEADER_TRACESTATE = "tracestate"
HEADER_BAGGAGE = "baggage"
