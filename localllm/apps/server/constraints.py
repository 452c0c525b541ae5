"""Constrained output (JSON, a schema, a GBNF grammar, tool calls) as token constraints: one compiled per output format (the server has one model)
and copied for each choice; copies share the masks they learn, so a schema that comes again
pays for its first masks once."""

from __future__ import annotations

import json
from collections import OrderedDict

from localllm.errors import GrammarError
from localllm.generation.constrain import TokenConstraint
from .errors import api_error
from .runs import OutputFormat


class Constraints:
    """The latest formats' compiled constraints, oldest dropped first (worker thread only)."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._items: OrderedDict[str, TokenConstraint] = OrderedDict()

    def get(self, model, fmt: OutputFormat):
        """The constraint of a format, never advanced itself: give each choice a copy().

        Raises:
            APIError: 400 for a schema the grammar compiler does not support, naming why.
        """
        if fmt.kind == "json_object":
            key = fmt.kind
        elif fmt.kind == "grammar":
            key = "gbnf:" + fmt.grammar
        elif fmt.kind == "tool_calls":
            key = "tools:" + fmt.schema.key()
        else:
            key = json.dumps(fmt.schema, sort_keys=True)
        c = self._items.get(key)
        if c is not None:
            self._items.move_to_end(key)
            return c
        try:
            if fmt.kind == "json_object":
                c = TokenConstraint.json_object(model.token_vocab)
            elif fmt.kind == "grammar":
                c = TokenConstraint.gbnf(fmt.grammar, model.token_vocab)
            elif fmt.kind == "tool_calls":
                c = fmt.schema.constraint(model.token_vocab)
            else:
                c = TokenConstraint.json_schema(fmt.schema, model.token_vocab)
        except GrammarError as e:
            raise api_error(e, fmt.param) from None
        except RecursionError:
            raise api_error(GrammarError("the schema or grammar is nested too deeply"), fmt.param) from None
        self._items[key] = c
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return c
