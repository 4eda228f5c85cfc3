"""A reward function of one's own (docs/guide/rewards.md): `reward.fn=examples/own_data/reward.py:score`."""


def score(response: str, ground_truth: str, *, data_source: str | None = None, extra: dict | None = None) -> dict:
    """1 when the response starts with the answer; `digit` (logged as reward/digit/mean) counts answers that start
    with a digit at all."""
    text = response.strip()
    return {"score": float(text.startswith(ground_truth)), "digit": float(text[:1].isdigit())}


async def judged(response: str, ground_truth: str, *, data_source: str | None = None,
                 extra: dict | None = None) -> float:
    """The same check written as an async function, as one that awaits a judge over the network would be:
    `reward.fn=examples/own_data/reward.py:judged reward.max_workers=0` awaits a batch's calls together."""
    return float(response.strip().startswith(ground_truth))
