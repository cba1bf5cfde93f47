"""Whether a grammar's output can ever be complete (issue 43): a Lark rule or a JSON schema
whose every alternative recurses into itself, with no base case, compiles in llguidance but
serves nothing (llguidance stops at once, an empty "stop") or writes until max_tokens (for a
json_schema, text that is not JSON). Both are found here, before a request is accepted.

The check is the textbook one for context-free grammars (a symbol is *productive* if one of
its alternatives is made only of terminals and productive symbols; iterate to a fixed point):
on the Lark rules, and on the $ref targets of a schema. It errs towards serving: anything it
cannot read is taken to be able to end.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping


class _Unreadable(Exception):
    """Syntax this check does not follow (the grammar is then taken to be able to end)."""


def _fixpoint(symbols, ends, uses: Mapping) -> set:
    """The productive ones of ``symbols``: ``ends(symbol, productive)`` says whether one of
    its alternatives ends, given the symbols already known to; ``uses[s]``, the symbols whose
    alternatives mention s, are looked at again when s is found to end (linear, not a pass
    over every symbol per symbol found)."""
    good: set = set()
    todo = list(symbols)
    while todo:
        s = todo.pop()
        if s not in good and ends(s, good):
            good.add(s)
            todo.extend(uses.get(s, ()))
    return good


def _some(names: list[str], k: int = 4) -> str:
    """The first ``k`` names, quoted, and how many more."""
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(repr(n) for n in names[:k]) + more


# --- JSON schemas ------------------------------------------------------------------------

_ANY = object()  # a $ref this check does not resolve (remote, an anchor): taken to end


def _resolve(root, ref: str):
    """The node a local $ref points to ("#", "#/$defs/x"); _ANY for others."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _ANY
    node = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _ANY  # a dangling ref is llguidance's to report
    return node


def _refs(node, out: set, root=None) -> set:
    """The $refs in ``node``; _Unreadable if a schema in it other than ``root`` has its own
    $id (its "#..." refs are then relative to it, which this check does not follow)."""
    if isinstance(node, Mapping):
        if root is not None and node is not root and "$id" in node:
            raise _Unreadable
        if isinstance(node.get("$ref"), str):
            out.add(node["$ref"])
        for value in node.values():
            _refs(value, out, root)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out, root)
    return out


def _schema_ends(node, good: set, root) -> bool:
    """Whether some finite JSON value satisfies ``node``, counting the $refs in ``good`` (and
    those not followed) as satisfiable."""
    if node is False:
        return False
    if not isinstance(node, Mapping):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref not in good and _resolve(root, ref) is not _ANY:
        return False

    def ends(sub):
        return _schema_ends(sub, good, root)

    if not all(ends(s) for s in node.get("allOf") or ()):
        return False
    for key in ("anyOf", "oneOf"):
        if node.get(key) and not any(ends(s) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or ())
    if not types or any(t not in ("object", "array") for t in types):
        return True  # a scalar (or, untyped, any value) ends
    if "object" in types:
        props = node.get("properties")
        props = props if isinstance(props, Mapping) else {}
        if all(ends(props.get(p, True)) for p in node.get("required") or ()
               if isinstance(p, str)):
            return True
    if "array" in types:
        n = node.get("minItems", 0)
        n = n if isinstance(n, int) else 0
        items = node.get("items", True)
        prefix = node.get("prefixItems") or (items if isinstance(items, list) else [])
        rest = node.get("additionalItems", True) if isinstance(items, list) else items
        if all(ends(s) for s in prefix[:n]) and (n <= len(prefix) or ends(rest)):
            return True
    return False


def json_schema_endless(schema) -> str | None:
    """Why no finite JSON value satisfies ``schema`` (None if one may, or if this check
    cannot follow the schema)."""
    try:
        return _json_endless(schema)
    except (_Unreadable, TypeError, RecursionError):  # malformed or deep: llguidance's to judge
        return None


def _json_endless(schema) -> str | None:
    refs = sorted(_refs(schema, set(), schema))
    uses: dict = {}
    for r in refs:
        for d in _refs(_resolve(schema, r), set()):
            uses.setdefault(d, set()).add(r)
    good = _fixpoint(refs, lambda r, good: _schema_ends(_resolve(schema, r), good, schema),
                     uses)
    if _schema_ends(schema, good, schema):
        return None
    stuck = [r for r in refs if r not in good]
    if not stuck:  # no $ref to blame: a required property that allows nothing, say
        return ("no JSON value matches the schema (a required part of it allows none), so no "
                "output could ever be complete")
    return (f"no finite JSON value matches the schema: its $ref {_some(stuck)} recurses with "
            "no base case (through required properties, minItems or allOf), so no output "
            "could ever be complete")


# --- Lark grammars -----------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<skip>[ \t\r]+|(?://|\#)[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-zA-Z]*)
  | (?P<special><[^<>\s]+>)
  | (?P<name>[_a-zA-Z][-_a-zA-Z0-9]*)
  | (?P<number>\d+)
  | (?P<op>\.\.|->|[:|()\[\]?*+~{},.!@%])
""", re.X)
_TERMINAL = "T"  # a token standing for anything that is not a rule (strings, regexes, ...)


def _skip_braces(text: str, i: int) -> int:
    """The index after the JSON object that starts at ``text[i] == "{"``."""
    depth, string = 0, False
    while i < len(text):
        c = text[i]
        if string:
            if c == "\\":
                i += 1
            elif c == '"':
                string = False
        elif c == '"':
            string = True
        elif c in "{}":
            depth += 1 if c == "{" else -1
            if not depth:
                return i + 1
        i += 1
    raise _Unreadable


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) of each token; ``%json {...}`` and ``%regex {...}`` are one terminal,
    ``%llguidance {...}`` nothing, and a newline before ``|`` continues the rule."""
    out, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise _Unreadable
        kind, value, i = m.lastgroup, m.group(), m.end()
        if kind == "op" and value == "%":
            d = _TOKEN.match(text, i)
            directive = d.group() if d and d.lastgroup == "name" else None
            j = d.end() if directive else i
            while j < len(text) and text[j] in " \t":
                j += 1
            if directive in ("json", "regex", "llguidance") and text[j:j + 1] == "{":
                i = _skip_braces(text, j)
                if directive != "llguidance":
                    out.append(("terminal", _TERMINAL))
                continue
            out.append(("directive", directive or ""))
            i = j
            continue
        if kind == "op" and value == "|":
            while out and out[-1][0] == "nl":
                out.pop()
        if kind in ("string", "regex", "special"):
            kind, value = "terminal", _TERMINAL
        if kind != "skip" and not (kind == "nl" and out and out[-1][0] == "nl"):
            out.append((kind, value))
    return out


class _LarkRules:
    """The rules of a Lark grammar as alternatives of sequences: a rule's body is True (it
    may be empty or is a terminal), a rule name, or ("seq" | "alt", [bodies])."""

    def __init__(self, text: str):
        self.toks, self.i = _tokens(text) + [("end", "")], 0
        self.rules: dict[str, list] = {}
        while self.peek()[0] != "end":
            self.statement()

    def peek(self, k: int = 0):
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def take(self, kind=None, value=None):
        tok = self.peek()
        if tok[0] == "end" or (kind and tok[0] != kind) or (value and tok[1] != value):
            raise _Unreadable
        self.i += 1
        return tok

    def to_line_end(self):
        while self.peek()[0] not in ("nl", "end"):
            self.i += 1

    def statement(self):
        if self.peek()[0] == "nl":
            self.i += 1
            return
        if self.peek()[0] == "directive":  # %ignore, %import, %declare: no rule
            self.to_line_end()
            return
        if self.peek() in (("op", "?"), ("op", "!")):
            self.i += 1
        name = self.take("name")[1]
        if self.peek() == ("op", "."):  # a priority
            self.i += 1
            self.take("number")
        if self.peek() == ("op", "["):  # lexeme options: lazy, capture, max_tokens...
            while self.take()[1] != "]":
                pass
        self.take("op", ":")
        if _is_terminal(name):
            self.to_line_end()  # a terminal: a regular language, which ends
            return
        body = self.expansions()
        if self.peek()[0] not in ("nl", "end"):
            raise _Unreadable
        self.rules.setdefault(name, []).append(body)

    def expansions(self):
        alts = [self.expansion()]
        while self.peek() == ("op", "|"):
            self.i += 1
            alts.append(self.expansion())
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def expansion(self):
        items = []
        while self.peek()[0] not in ("nl", "end") and self.peek()[1] not in ("|", ")", "]"):
            if self.peek() == ("op", "->"):  # an alias names the tree node: nothing here
                self.i += 1
                self.take("name")
                break
            items.append(self.item())
        return ("seq", items)

    def item(self):
        kind, value = self.take()
        if (kind, value) == ("op", "("):
            node = self.expansions()
            self.take("op", ")")
        elif (kind, value) == ("op", "["):
            self.expansions()
            self.take("op", "]")
            node = True
        elif kind == "terminal":
            node = True
            if self.peek() == ("op", ".."):  # "a".."z"
                self.i += 1
                self.take("terminal")
        elif (kind, value) == ("op", "@"):  # another grammar of the request
            self.take()
            node = True
        elif kind == "name":
            node = True if _is_terminal(value) else value
        else:
            raise _Unreadable
        while True:  # quantifiers
            op = self.peek()
            if op in (("op", "?"), ("op", "*")):
                self.i += 1
                node = True
            elif op == ("op", "+"):
                self.i += 1
            elif op == ("op", "~"):  # x ~ n or x ~ n..m
                self.i += 1
                if int(self.take("number")[1]) == 0:
                    node = True
                if self.peek() == ("op", ".."):
                    self.i += 1
                    self.take("number")
            elif op == ("op", "{"):  # x{n}, x{n,}, x{,m}, x{n,m}
                self.i += 1
                low = int(self.take()[1]) if self.peek()[0] == "number" else 0
                while self.take()[1] != "}":
                    pass
                if low == 0:
                    node = True
            else:
                return node


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def _names(body, out: set) -> set:
    """The rules a body (or list of bodies) mentions."""
    if isinstance(body, str):
        out.add(body)
    elif isinstance(body, tuple):  # ("seq" | "alt", parts)
        _names(body[1], out)
    elif isinstance(body, list):
        for part in body:
            _names(part, out)
    return out


def _body_ends(body, good: set, rules: Mapping) -> bool:
    if body is True:
        return True
    if isinstance(body, str):
        return body in good or body not in rules  # an undefined rule is llguidance's error
    kind, parts = body
    test = all if kind == "seq" else any
    return test(_body_ends(p, good, rules) for p in parts)


def lark_endless(text: str) -> str | None:
    """Why no output of the Lark grammar ``text`` can be complete (None if one can, or if
    this check cannot read the grammar)."""
    try:
        rules = _LarkRules(text).rules
    except (_Unreadable, ValueError, RecursionError):
        return None
    if "start" not in rules:
        return None
    uses: dict = {}
    for r, bodies in rules.items():
        for d in _names(bodies, set()):
            uses.setdefault(d, set()).add(r)
    good = _fixpoint(list(rules), lambda r, good: any(
        _body_ends(b, good, rules) for b in rules[r]), uses)
    if "start" in good:
        return None
    stuck = sorted(r for r in rules if r not in good)
    names = _some(stuck)
    which = f"rule {names} recurses" if len(stuck) == 1 else f"rules {names} recurse"
    return (f"no output can ever be complete: {which} with no base case (each alternative "
            "needs one of them again)")


MAX_ALTERNATIVES = 2000  # llguidance's Earley items per row (LLParserLimits.max_items_in_row)


def lark_too_wide(text: str) -> str | None:
    """Why the Lark grammar ``text`` cannot start: a rule of more alternatives than
    llguidance's Earley row holds (predicting the rule adds one item per alternative, so it
    fails at the first token). None if every rule fits, or if this check cannot read it."""
    try:
        rules = _LarkRules(text).rules
    except (_Unreadable, ValueError, RecursionError):
        return None
    for name, bodies in rules.items():
        n = sum(len(b[1]) if isinstance(b, tuple) and b[0] == "alt" else 1 for b in bodies)
        if n > MAX_ALTERNATIVES:
            return (f"rule {name} has {n} alternatives, more than the {MAX_ALTERNATIVES} a step "
                    f"of llguidance's parser holds: write them as one terminal "
                    f"({name.upper()}_T: \"a\" | \"b\" | ...), or use choice")
    return None
