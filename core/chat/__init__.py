"""The chat library every process shares: tokenizers, chat templates, tool-call parsing, model files.

Ground floor: imports nothing of agl but :mod:`agl.errors`, :mod:`agl.types` and the other
ground-floor modules, so the gateway, the engine, the span adapter, the trainer and the CLI can all
import it. Runs in whichever process asks: the gateway (rendering and parsing each call), the
trainer (re-tokenising a call whose ids are missing), the CLI (``agl models``).

- :mod:`agl.chat.tokenizer`: ``ChatTokenizer`` and the loaders (the SmolLM2 tokenizer ships as
  package data in ``assets/``);
- :mod:`agl.chat.format`: rendering a conversation with tools, parsing tool calls out of text;
- :mod:`agl.chat.stream_text`: what a streamed reply's token deltas may send;
- :mod:`agl.chat.models`: the default model and the prepared model folders.
"""
