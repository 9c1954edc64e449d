"""Sample data for the demo, tests and benchmarks: short support tickets over five labels.

Tickets are built from phrase lists with a seeded random generator, so a given ``(n, seed)`` always gives the
same archive. The true label of each ticket is kept aside (never sent with the record) to score a zero-shot
classifier. ``write_archive`` also salts the file with malformed lines, the way real archives come.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

LABELS = ("billing", "shipping", "technical", "account", "refund")
# Descriptive label texts: what a zero-shot classifier embeds for each label (engine.label_texts).
LABEL_TEXTS = {
    "billing": "billing: invoice, charge on my card, payment, subscription price, receipt",
    "shipping": "shipping: delivery of my package, parcel tracking, courier, order has not arrived",
    "technical": "technical problem: the app crashes, error message, bug, website not loading",
    "account": "account access: login, password reset, username, email address, profile settings",
    "refund": "refund: money back, return the item, cancel the order and reimburse me",
}

_ISSUES = {
    "billing": (
        "I was charged twice for my subscription this month",
        "the invoice shows the wrong amount",
        "my card was billed after I changed plans",
        "I need a copy of the receipt for order {n}",
        "why did the price of my plan go up",
        "the payment failed but the charge still appears on my statement",
        "please update the billing address on my invoices",
        "there is an unknown charge of {amount} on my card",
    ),
    "shipping": (
        "my package has not arrived yet",
        "the tracking number for order {n} does not work",
        "the courier left the parcel at the wrong address",
        "delivery was supposed to be on {day} but nothing came",
        "can you ship my order faster",
        "the parcel has been stuck in transit for a week",
        "I want to change the delivery address of order {n}",
        "the box arrived damaged and half empty",
    ),
    "technical": (
        "the app crashes every time I open it",
        "I get error {code} when I upload a file",
        "the website will not load on my phone",
        "the export button does nothing since the last update",
        "sync between my laptop and the app stopped working",
        "the page freezes after I click save",
        "notifications stopped working on android",
        "the search returns a blank screen",
    ),
    "account": (
        "I cannot log in to my account",
        "the password reset email never arrives",
        "please change the email address on my profile",
        "my account was locked after too many attempts",
        "how do I delete my account",
        "I want to change my username",
        "two-factor codes are not accepted when I sign in",
        "someone else may have accessed my account",
    ),
    "refund": (
        "I want my money back for order {n}",
        "I returned the item two weeks ago and still have no refund",
        "please cancel my order and reimburse me",
        "the product was not as described, I want a refund",
        "how long does a refund take to reach my bank",
        "I was promised a refund of {amount} but never got it",
        "can I return these shoes for a full refund",
        "refund the unused months of my plan please",
    ),
}
_OPENERS = ("", "Hi, ", "Hello team, ", "Hey, ", "Good morning, ", "Urgent: ", "Hi support, ")
_CLOSERS = ("", " Thanks.", " Please help.", " Thank you!", " This is the second time I write.", " Regards, Sam")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")


@dataclass(frozen=True)
class Ticket:
    id: str
    text: str
    label: str


@dataclass
class Archive:
    """A JSONL archive of tickets: what was written where, and the true labels kept aside."""

    path: Path
    tickets: list[Ticket]
    lines: int
    malformed: int
    truth: dict[str, str] = field(default_factory=dict)


def tickets(n: int, seed: int = 7) -> list[Ticket]:
    """``n`` tickets, labels in equal shares, in shuffled order."""
    rng = random.Random(seed)
    out: list[Ticket] = []
    for i in range(n):
        label = LABELS[i % len(LABELS)]
        issue = rng.choice(_ISSUES[label]).format(
            n=rng.randint(10000, 99999),
            amount=f"${rng.randint(5, 300)}.{rng.randint(0, 99):02d}",
            day=rng.choice(_DAYS),
            code=rng.choice(("500", "403", "E42", "0x80070005")),
        )
        opener = rng.choice(_OPENERS)
        text = f"{opener}{issue[0].upper() if not opener else issue[0]}{issue[1:]}.{rng.choice(_CLOSERS)}"
        out.append(Ticket(f"ticket-{i:06d}", text, label))
    rng.shuffle(out)
    return out


def _malformed(rng: random.Random, i: int) -> bytes:
    kind = i % 4
    if kind == 0:
        return b'{"id": "broken-%d", "text": "my order' % i  # truncated JSON
    if kind == 1:
        return b"\xff\xfe not utf-8 \x80"
    if kind == 2:
        return json.dumps({"id": f"bad-{i}", "text": "two inputs", "prompt": "at once"}).encode()  # schema
    return json.dumps(["not", "an", "object", rng.randint(0, 9)]).encode()


def write_archive(path: Path, n: int, seed: int = 7, malformed_rate: float = 0.01) -> Archive:
    """Write ``n`` lines of JSONL to ``path``: tickets as ``{"id", "text"}`` plus ~``malformed_rate`` bad lines."""
    rng = random.Random(seed + 1)
    bad = round(n * malformed_rate)
    good = tickets(n - bad, seed)
    bad_at = set(rng.sample(range(n), bad))
    lines: list[bytes] = []
    it = iter(good)
    for i in range(n):
        if i in bad_at:
            lines.append(_malformed(rng, i))
        else:
            t = next(it)
            lines.append(json.dumps({"id": t.id, "text": t.text}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return Archive(path, good, n, bad, {t.id: t.label for t in good})
