"""Example agent written against the OpenAI API, trained token-exactly through relayrl's traced server.

    relayrl rl --rollout.agent examples/openai_agent.py ...
    # or: executor = load_agent_from_file("examples/openai_agent.py", engine, tokenizer)

relayrl serves the policy on 127.0.0.1 and calls `openai_agent(base_url, session_id, sample)` once per
episode. Send the session id with every call (header X-Session-Id); the server records the exact prompt and
sampled token ids of each call and builds the trajectory from them. Keep the conversation history verbatim
(the server reports, and the trainer drops, sessions whose history was rewritten).
"""

from __future__ import annotations

import openai


async def openai_agent(base_url: str, session_id: str, sample) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    headers = {"X-Session-Id": session_id}
    messages = [{"role": "user", "content": sample.prompt}]
    answer = ""
    try:
        for turn in range(2):
            reply = await client.chat.completions.create(
                model="relayrl", messages=messages, max_tokens=16, extra_headers=headers
            )
            answer = reply.choices[0].message.content.strip()
            if answer == str(sample.label):
                return {"rewards": 1.0 / (turn + 1), "scores": 1.0, "extra_logs": {"turns": turn + 1}}
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Wrong. Answer with the number only."}]  # fmt: skip
    finally:
        await client.close()
    return {"rewards": 0.0, "scores": 0.0, "extra_logs": {"turns": 2}}
