"""KV-cache metadata on the CPU: physical pages, request slots and the page-granular prefix tree."""

from m3serve.core.kvcache.pages import PagePool
from m3serve.core.kvcache.radix import Match, Node, PrefixCache, RadixTree
from m3serve.core.kvcache.slots import SlotPool

__all__ = ["Match", "Node", "PagePool", "PrefixCache", "RadixTree", "SlotPool"]
