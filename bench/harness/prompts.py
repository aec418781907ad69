"""Fixed natural-language prompts that speculative decoding is measured on, in the engine and through a server.

A code edit: the prompt holds a small Python file and asks for it back with one name changed, so the answer
repeats its prompt (where prompt lookup shines). Plain chat questions: answers that repeat little.
"""

from __future__ import annotations

CODE_FILE = '''\
import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1

    def total(self) -> float:
        return self.price * self.quantity


class Cart:
    def __init__(self) -> None:
        self.items: list[Item] = []

    def add(self, item: Item) -> None:
        self.items.append(item)

    def remove(self, name: str) -> None:
        self.items = [i for i in self.items if i.name != name]

    def total(self) -> float:
        return sum(i.total() for i in self.items)

    def to_json(self) -> str:
        return json.dumps([i.__dict__ for i in self.items])


def load_cart(text: str) -> Cart:
    cart = Cart()
    for row in json.loads(text):
        cart.add(Item(row["name"], row["price"], row["quantity"]))
    return cart
'''

# (old, new) names of CODE_FILE; the first is the engine benchmark's edit.
RENAMES = (("Cart", "ShoppingCart"), ("Item", "LineItem"), ("load_cart", "parse_cart"), ("remove", "discard"))


def code_task(old: str, new: str) -> str:
    """The code-edit request: CODE_FILE, then the instruction to rename `old` to `new` and reply with the file."""
    kind = "class" if old[:1].isupper() else "function" if old == "load_cart" else "method"
    return ("Here is a Python file:\n\n```python\n" + CODE_FILE + f"```\n\nRename the {kind} `{old}` to "
            f"`{new}` everywhere. Reply with the whole updated file in one code block, nothing else.")


CODE_TASK = code_task(*RENAMES[0])

CHAT = (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
    "Give me three tips for learning Python.", "Why is the sky blue?", "Describe a cat to a child.",
    "What is 17 times 23?", "Name the planets of the solar system.",
)
