"""`relayrl chat`: talk to a model folder in the terminal, the reply streamed token by token.

    relayrl chat --model.name_or_path runs/sft/final [--system "You are terse."] [--temperature 0.7]

Each line read from stdin is a user turn; the conversation so far (system prompt, every user turn and every
reply) is rendered with the tokenizer's chat template and the model answers it. Commands: `/reset` clears
the history (the system prompt stays), `/exit` (or end of input) quits; Ctrl-C stops the reply being
written (it is not kept in the history) and the chat goes on.

Prompt: the tokenizer's chat template with the generation prompt. A tokenizer without one (a base model)
gets the plain format below, and its reply also stops where the model starts the next "User:" turn:

    {system}\\n\\n                      (only with --system)
    User: {turn 1}\\nAssistant: {reply 1}\\n
    User: {turn 2}\\nAssistant:

Decoding (`stream_reply`): one prefill of the prompt, then one forward per token over the HF model's KV cache
(the rollout engines return whole completions, so they cannot stream); tokens are sampled by the engines'
sampler (relayrl.rollout.sampling: temperature, top_p, top_k; counter-based uniforms from the session seed
and the turn, so a seeded session replays exactly). The reply text is decoded incrementally (the difference
between the decodes of a sliding window of ids, held back while it ends in an incomplete UTF-8 character)
and every new piece is written and flushed as soon as it is produced. The reply ends at an EOS / stop token
(not shown), at a stop string, at max_new_tokens, or at the model's context length. The history is rendered
again every turn (no KV reuse across turns: simple, and cheap at chat lengths).
"""

from __future__ import annotations

import inspect
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from relayrl.config.apps import ChatConfig
from relayrl.config.base import ConfigError
from relayrl.config.command_line import run_command
from relayrl.data.templates import encode
from relayrl.models.loading import load_tokenizer, resolve_device
from relayrl.rollout.hf import default_eos_ids
from relayrl.rollout.sampling import sample_tokens, uniform
from relayrl.workers.builders import build_frozen

PLAIN_USER, PLAIN_ASSISTANT = "User:", "Assistant:"
PLAIN_STOPS = ("\nUser:",)
"""Stop strings of the plain format (a base model goes on to write the user's next turn)."""
COMMANDS = "/reset clears the history, /exit (or Ctrl-D) quits"


# ---------------------------------------------------------------------------------------------- text
def render_plain(messages: list[dict[str, str]]) -> str:
    """The plain "User:/Assistant:" prompt of a conversation, ending with "Assistant:" (module doc)."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(f"{m['content']}\n\n")
        else:
            who = PLAIN_USER if m["role"] == "user" else PLAIN_ASSISTANT
            parts.append(f"{who} {m['content']}\n")
    return "".join(parts) + PLAIN_ASSISTANT


def render_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text: the chat template with the generation prompt, else the plain format."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return render_plain(messages)


class IncrementalDecoder:
    """Token ids in, new text out: decodes a sliding window of ids (from `prefix` on) and returns what the
    last token added, holding it back while it ends in U+FFFD (an incomplete multi-byte character) -- the
    detokenizer of TGI / vLLM, which is exact for tokenizers whose decode depends on neighbouring tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._text(self.ids[self.prefix : self.read])
        after = self._text(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""


class StopStrings:
    """Streams text while watching for stop strings: `feed` returns the part that is safe to show (a tail
    that could begin a stop string is held back) and whether a stop string was reached; `flush` returns the
    held-back tail at the end. The shown text never contains a stop string."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.shown = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return self._take(len(self.text)), True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._take(len(self.text) - hold), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.shown : max(end, self.shown)]
        self.shown = max(end, self.shown)
        return out


# ---------------------------------------------------------------------------------------------- decoding
@dataclass(kw_only=True, slots=True)
class Reply:
    """One streamed reply."""

    text: str
    """The reply text as shown (no stop token, no stop string)."""
    token_ids: list[int]
    """[G] the generated ids (the stop token excluded)."""
    finish: str
    """stop (a stop token or stop string), length (max_new_tokens or the context limit)."""


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS and every EOS id of the model's generation config (chat models often list the
    end-of-turn token there)."""

    ids = set(default_eos_ids(model, tokenizer))
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set([gen] if isinstance(gen, int) else gen or [])
    return ids


def _cache_of(out: Any) -> Any:
    """The KV cache a forward returned (transformers >= 5.2x names it `cache`, earlier `past_key_values`)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def stream_reply(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    cfg: ChatConfig,
    write: Callable[[str], None],
    *,
    seed: int,
    stops: Iterable[str] = (),
    max_len: int | None = None,
) -> Reply:
    """Generate one reply to `prompt_ids`, calling `write(piece)` for every new piece of text as soon as it
    is decoded (module doc). `max_len`: the model's context length (prompt + reply)."""
    import torch

    device = next(model.parameters()).device
    budget = cfg.max_new_tokens if max_len is None else min(cfg.max_new_tokens, max_len - len(prompt_ids))
    mode = "greedy" if cfg.temperature == 0 else "truncate" if cfg.top_p < 1 or cfg.top_k > 0 else "sample"
    temp, top_p = (
        torch.tensor([v], dtype=torch.float32, device=device) for v in (cfg.temperature, cfg.top_p)
    )
    top_k = torch.tensor([cfg.top_k], dtype=torch.int64, device=device)
    seed_t = torch.tensor([seed], dtype=torch.int64, device=device)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    eos, decoder, shown = stop_token_ids(model, tokenizer), IncrementalDecoder(tokenizer), StopStrings(stops)
    ids: list[int] = []
    finish = "length"
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
        for step in range(budget):
            u = uniform(seed_t, torch.tensor([step], dtype=torch.int64, device=device))
            tok, _ = sample_tokens(out.logits[:, -1, :], temp, top_p, top_k, u, mode)
            token = int(tok.item())
            if token in eos:
                finish = "stop"
                break
            ids.append(token)
            piece, stopped = shown.feed(decoder.push(token))
            if piece:
                write(piece)
            if stopped:
                finish = "stop"
                break
            if step + 1 == budget:
                break
            out = model(input_ids=tok.view(1, 1), use_cache=True, **{cache_arg: _cache_of(out)})
    tail = shown.flush()
    if tail:
        write(tail)
    return Reply(text=shown.text, token_ids=ids, finish=finish)


# ---------------------------------------------------------------------------------------------- session
class ChatSession:
    """A conversation with one model: the history, and one streamed reply per user turn."""

    def __init__(self, model: Any, tokenizer: Any, cfg: ChatConfig) -> None:
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(2**31)
        self.stops = () if getattr(tokenizer, "chat_template", None) else PLAIN_STOPS
        self.max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.messages: list[dict[str, str]] = []
        """The conversation so far ({role, content} dicts), what the next turn's prompt renders."""
        self.prompts: list[list[int]] = []
        """The prompt ids of every turn answered, in order (the whole rendered conversation each time)."""
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []

    def reply(self, text: str, write: Callable[[str], None]) -> Reply | None:
        """Answer the user turn `text`, streaming through `write`; the turn and the reply join the history.
        None (history unchanged) when the conversation no longer fits the model's context: /reset."""

        messages = [*self.messages, {"role": "user", "content": text}]
        ids = encode(self.tokenizer, render_conversation(self.tokenizer, messages))
        if self.max_len is not None and len(ids) >= self.max_len:
            return None
        self.prompts.append(ids)
        seed = (self.seed * 1_000_003 + len(self.prompts) * 7919) % (2**31)  # one stream per turn
        out = stream_reply(
            self.model,
            self.tokenizer,
            ids,
            self.cfg,
            write,
            seed=seed,
            stops=self.stops,
            max_len=self.max_len,
        )
        self.messages = [*messages, {"role": "assistant", "content": out.text.strip()}]
        return out


def _answer(session: ChatSession, line: str, write: Callable[[str], None]) -> int:
    """One user turn: 1 when answered; Ctrl-C stops the reply (not kept in the history), the chat goes on."""
    try:
        reply = session.reply(line, write)
    except KeyboardInterrupt:
        write("\n")
        print("(reply interrupted; it is not kept in the history)", file=sys.stderr, flush=True)
        return 0
    if reply is None:
        print("(the conversation is longer than the model's context: /reset)", file=sys.stderr, flush=True)
        return 0
    write("\n")
    return 1


def chat_loop(session: ChatSession, lines: Iterable[str], out: TextIO, *, interactive: bool = False) -> int:
    """Answer every line of `lines` (module doc: /reset, /exit); returns the number of replies."""

    def write(piece: str) -> None:
        out.write(piece)
        out.flush()

    replies = 0
    if interactive:
        write("> ")
    for raw in lines:
        line = raw.strip()
        if line == "/exit":
            break
        if line == "/reset":
            session.reset()
            print("(history cleared)", file=sys.stderr, flush=True)
        elif line.startswith("/"):
            print(f"unknown command {line.split()[0]!r}: {COMMANDS}", file=sys.stderr, flush=True)
        elif line:
            replies += _answer(session, line, write)
        if interactive:
            write("> ")
    return replies


def run_chat(cfg: ChatConfig, stdin: TextIO | None = None, stdout: TextIO | None = None) -> ChatSession:
    """Load the model and chat over `stdin` / `stdout` (default the process's) until /exit or end of input;
    returns the session (its history and per-turn prompt ids)."""

    lines = sys.stdin if stdin is None else stdin
    out = sys.stdout if stdout is None else stdout
    m = cfg.model
    if not m.name_or_path:
        raise ConfigError(
            "model.name_or_path: required: a local model folder or Hub id", field="model.name_or_path"
        )
    tokenizer = load_tokenizer(
        m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
    )
    model = build_frozen(m, resolve_device(cfg.device))
    session = ChatSession(model, tokenizer, cfg)
    fmt = "the plain User:/Assistant: format (no chat template)" if session.stops else "its chat template"
    print(f"relayrl chat: {m.name_or_path} with {fmt}; {COMMANDS}", file=sys.stderr, flush=True)
    chat_loop(session, lines, out, interactive=lines.isatty())
    return session


def main(argv: list[str] | None = None) -> int:
    """`relayrl chat --model.name_or_path PATH [--system TEXT] [--temperature T] ...`."""

    def go(cfg: ChatConfig) -> int:
        run_chat(cfg)
        return 0

    return run_command(ChatConfig, argv, "relayrl chat", go, description=(__doc__ or "").split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
