"""Episodes written against the ``openai`` client, for the openai-agent tests.

Nothing here knows about realhf: the client could point at any OpenAI-compatible server.
"""

from __future__ import annotations


async def ask_twice(client, row) -> float:
    """Ask the question, then ask the model to check its answer; reward: +1 when the two
    replies agree, else −1."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=1.0
    )
    a = first.choices[0].message.content
    messages += [
        {"role": "assistant", "content": a},
        {"role": "user", "content": " Check it:"},
    ]
    second = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=1.0
    )
    return 1.0 if second.choices[0].message.content == a else -1.0


def not_async(client, row):
    return 0.0
