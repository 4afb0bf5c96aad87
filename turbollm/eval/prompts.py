"""Fixed parity prompts of about 8, 64 and 300 tokens: English, Chinese mixed with English, and code.

Written for this project (no evaluation data is used, so nothing is calibrated on it).
"""

SHORT = "The quick brown fox jumps over the lazy"

MIXED = (
    "机器学习是人工智能的一个分支，它让计算机从数据中学习规律。Machine learning lets computers "
    "improve with experience instead of explicit rules. 深度学习使用多层神经网络提取特征，例如卷积网络"
    "和 Transformer。In 2017 the Transformer changed natural language processing, and today 大语言模型"
    "can write code, translate text and answer questions."
)

CODE = '''import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


class LRUCache:
    """A least-recently-used cache with a fixed capacity (容量固定的缓存)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._data: OrderedDict[str, int] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> int | None:
        if key not in self._data:
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return self._data[key]

    def put(self, key: str, value: int) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)


@dataclass(order=True)
class Task:
    priority: int
    name: str = field(compare=False)


def schedule(tasks: list[Task], budget: int) -> list[str]:
    """Run the most urgent tasks first until the budget is spent."""
    heap = list(tasks)
    heapq.heapify(heap)
    done = []
    while heap and budget > 0:
        task = heapq.heappop(heap)
        done.append(task.name)
        budget -= task.priority
    return done


if __name__ == "__main__":
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    print(cache.get("a"), cache.get("c"))
'''

PARITY_PROMPTS = {"short": SHORT, "mixed": MIXED, "code": CODE}
