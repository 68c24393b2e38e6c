"""A fleet file's YAML, with PyYAML: text → plain values (duplicate keys, unsupported tags and
expansion bombs as diagnostics), and the line/column of each value and key. reconciler/fleetfile/source.py
imports it only when a text is parsed: a validation kept by desiredcache.py never loads PyYAML."""

from __future__ import annotations

import re
from typing import Any

import yaml

from reconciler.core.diagnostics import Diagnostic, Pos, SourceRange, error, format_path
from reconciler.fleetfile.source import MAX_DEPTH, MAX_NODES, MAX_NUMBER_CHARS, Document, YamlPath, offset_pos


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader with YAML 1.2 core scalars: `19:00` stays a string (not the base-60 int 1140),
    `no`/`on` stay strings (not booleans), dates stay strings. Integers are built by
    _Builder.integer, never by PyYAML's YAML 1.1 constructor (`07070` is 7070 there, not octal)."""


_Loader.yaml_implicit_resolvers = {}
for _tag, _regexp, _first in (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    ("tag:yaml.org,2002:float",
     r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
     "-+0123456789."),
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    # Clearing the resolvers above dropped this one too: without it `<<: *base` was the key "<<".
    ("tag:yaml.org,2002:merge", r"^(?:<<)$", ["<"]),
):
    _Loader.add_implicit_resolver(_tag, re.compile(_regexp), list(_first))


def _pos(mark: Any) -> Pos:
    return Pos(mark.line + 1, mark.column + 1)


def marks(text: str, filename: str) -> tuple[dict[YamlPath, tuple[Pos, Pos]], dict[YamlPath, tuple[Pos, Pos]]]:
    """The range of each value and of each key of a text that parsed, by YAML path."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()  # it composed once already: the same tree again
    finally:
        loader.dispose()
    builder = _Builder(None, filename, record=True)
    builder.build(root, ())
    return builder.marks, builder.key_marks


def parse(text: str, filename: str) -> tuple[Document | None, list[Diagnostic]]:
    """source.parse, which calls this with the cyclic collector off."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        return None, [_syntax_diagnostic(exc, filename)]
    except yaml.reader.ReaderError as exc:  # a control character: it has an offset, not a mark
        where = offset_pos(text.encode("utf-8"), len(text[:exc.position].encode("utf-8")))
        return None, [error("yaml_syntax", f"character {exc.character!r} is not allowed in YAML text",
                            "Control characters other than tab and newline cannot appear in a YAML file.",
                            range=SourceRange(filename, where, where))]
    except yaml.YAMLError as exc:  # any other error without a mark
        return None, [error("yaml_syntax", f"invalid YAML: {exc}",
                            range=SourceRange(filename, Pos(1, 1), Pos(1, 1)))]
    finally:
        loader.dispose()
    if root is None:
        return None, [error("config_empty", f"{filename} holds no YAML document",
                             "Start from fleet.yaml.example: a fleet file needs at least `version`, "
                             "`control_plane` and `nodes`.",
                             range=SourceRange(filename, Pos(1, 1), Pos(1, 1)))]
    builder = _Builder(loader, filename)
    try:
        _check_expansion(root)
        data = builder.build(root, ())
    except _TooComplex as exc:
        return None, [error("yaml_too_complex", str(exc),
                            "Anchors and aliases may not expand the file past "
                            f"{MAX_NODES:,} values or {MAX_DEPTH} levels of nesting.",
                            range=SourceRange(filename, exc.pos, exc.pos))]
    return Document.parsed(filename, text, data), builder.diagnostics


def _syntax_diagnostic(exc: yaml.MarkedYAMLError, filename: str) -> Diagnostic:
    mark = exc.problem_mark or exc.context_mark
    pos = _pos(mark) if mark else Pos(1, 1)
    problem = exc.problem or "invalid YAML"
    detail = ""
    if "'\\t'" in problem or "tab character" in problem:
        problem = "a tab character where YAML expects indentation or a value"
        detail = "YAML indents with spaces only: replace the tab with spaces."
    elif "mapping values are not allowed" in problem:
        detail = ("Usually a key indented differently from the keys above it, or a value holding "
                  "': ' that needs quotes.")
    elif exc.context:
        detail = f"{exc.context}"
        if exc.context_mark and exc.problem_mark and exc.context_mark.line != exc.problem_mark.line:
            detail += f" (line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
    return error("yaml_syntax", f"YAML syntax error: {problem}", detail,
                 range=SourceRange(filename, pos, pos))


_PLAIN_TAGS = frozenset({"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"})
_MERGE = "tag:yaml.org,2002:merge"
_STR, _INT, _NULL = "tag:yaml.org,2002:str", "tag:yaml.org,2002:int", "tag:yaml.org,2002:null"
_FLOAT = "tag:yaml.org,2002:float"
Pair = tuple[yaml.Node, yaml.Node]


class _TooComplex(Exception):
    def __init__(self, message: str, pos: Pos) -> None:
        super().__init__(message)
        self.pos = pos


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a tree whose aliases would expand it past MAX_NODES values or MAX_DEPTH levels,
    before building anything: each distinct node is sized once (an alias is the same node
    object as its anchor), so a billion-laughs file is refused at the cost of its own size."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise _TooComplex(f"the YAML nests deeper than {MAX_DEPTH} levels (a recursive alias?)",
                              _pos(node.start_mark))
        known = sizes.get(id(node))
        if known is not None:
            return known
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k, depth + 1) + size(v, depth + 1) for k, v in node.value)
        if total > MAX_NODES:
            raise _TooComplex(f"the YAML expands to more than {MAX_NODES:,} values", _pos(node.start_mark))
        sizes[id(node)] = total
        return total

    size(root, 0)


class _Builder:
    """Constructs plain Python values from the node tree, with duplicate keys as diagnostics.
    Keys are taken as written (`no:` is the string "no"), since every key in a fleet file is a name.
    `record`: record the range of every value and key instead (for _Marks; no values constructed)."""

    def __init__(self, loader: Any, filename: str, *, record: bool = False) -> None:
        self.loader = loader
        self.filename = filename
        self.record = record
        self.marks: dict[YamlPath, tuple[Pos, Pos]] = {}
        self.key_marks: dict[YamlPath, tuple[Pos, Pos]] = {}
        self.diagnostics: list[Diagnostic] = []
        self.count = 0

    def build(self, node: yaml.Node, path: YamlPath) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise _TooComplex(f"the YAML expands to more than {MAX_NODES:,} values", _pos(node.start_mark))
        if len(path) > MAX_DEPTH:
            raise _TooComplex(f"the YAML nests deeper than {MAX_DEPTH} levels (a recursive alias?)",
                              _pos(node.start_mark))
        if self.record:
            self.marks.setdefault(path, (_pos(node.start_mark), _pos(node.end_mark)))
        tag = node.tag
        if isinstance(node, yaml.ScalarNode):
            if self.record:
                return None
            # The tags of nearly every value, constructed as SafeConstructor would, without its
            # dispatch (a third of building a large file's values); anything else goes to it.
            if tag == _STR:
                return node.value
            if tag == _INT:
                return self.integer(node, path)
            if tag == _FLOAT and len(node.value) > MAX_NUMBER_CHARS:
                return self.too_long(node, path)
            if tag == _NULL:
                return None
            if tag == _MERGE:  # `<<` written as a value, not as a key: the string it looks like
                return str(node.value)
            try:
                return self.loader.construct_object(node, deep=True)
            except (yaml.MarkedYAMLError, ValueError, TypeError) as exc:  # an explicit tag: !!binary, !!python/…, `!!float x`
                problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) else None
                self.diagnostics.append(error(
                    "yaml_syntax", f"unsupported YAML value: {problem or exc}",
                    "Fleet files hold plain strings, numbers, booleans, lists and mappings.",
                    address=format_path(path),
                    range=SourceRange(self.filename, _pos(node.start_mark), _pos(node.end_mark))))
                return None
        if tag not in _PLAIN_TAGS:
            self.diagnostics.append(error(
                "yaml_syntax", f"unsupported YAML tag {tag!r}",
                "Fleet files hold plain strings, numbers, booleans, lists and mappings.",
                address=format_path(path),
                range=SourceRange(self.filename, _pos(node.start_mark), _pos(node.end_mark))))
            return None
        if isinstance(node, yaml.MappingNode):
            return self.mapping(node, path)
        return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]

    def integer(self, node: yaml.ScalarNode, path: YamlPath) -> Any:
        """An integer scalar (plain, or tagged !!int) as YAML 1.2 writes it in JSON's form: decimal
        digits with an optional sign, no leading zero. Hexadecimal and octal (YAML 1.2's core schema
        has them, JSON's does not) and leading zeros (octal to YAML 1.1 tools, decimal to 1.2 ones)
        are refused with the decimal value to write instead; the length is checked before anything
        is converted. A refused form still stands for its value, so the schema says nothing more."""
        text = node.value
        if len(text) > MAX_NUMBER_CHARS:
            return self.too_long(node, path)
        body = text[1:] if text[:1] in ("+", "-") else text
        if body.isascii() and body.isdigit():
            if len(body) == 1 or body[0] != "0":
                return int(text)
            value = int(text)
            self.number_form(node, path, f"{text} is written with a leading zero (YAML 1.1 reads it as octal, "
                                         "YAML 1.2 as decimal)", value)
            return value
        base = 16 if re.fullmatch(r"0x[0-9a-fA-F]+", body) else 8 if re.fullmatch(r"0o[0-7]+", body) else 0
        if base:
            value = int(body[2:], base) * (-1 if text.startswith("-") else 1)
            self.number_form(node, path, f"{text} is written in {'hexadecimal' if base == 16 else 'octal'}", value)
            return value
        self.diagnostics.append(error(
            "yaml_syntax", f"{text!r} is tagged as an integer but is not one",
            "Write the integer in decimal digits, or remove the !!int tag.", address=format_path(path),
            range=SourceRange(self.filename, _pos(node.start_mark), _pos(node.end_mark))))
        return text

    def number_form(self, node: yaml.ScalarNode, path: YamlPath, why: str, value: int) -> None:
        self.diagnostics.append(error(
            "yaml_integer_form", f"{format_path(path) or 'the value'}: {why}",
            f"Fleet files take integers in decimal, as JSON and YAML 1.2 write them: {value}.",
            address=format_path(path),
            range=SourceRange(self.filename, _pos(node.start_mark), _pos(node.end_mark))))

    def too_long(self, node: yaml.ScalarNode, path: YamlPath) -> str:
        """A number longer than MAX_NUMBER_CHARS, refused unconverted: it stands as its text
        (shortened), so the schema's own complaint about a string is left out (config.load_text)."""
        self.diagnostics.append(error(
            "yaml_number_too_long",
            f"{format_path(path) or 'the value'}: a number of {len(node.value):,} characters",
            f"A number in a fleet file (a port, a count, a size) is at most {MAX_NUMBER_CHARS} characters long.",
            address=format_path(path),
            range=SourceRange(self.filename, _pos(node.start_mark), _pos(node.end_mark))))
        return str(node.value)[:MAX_NUMBER_CHARS] + "..."

    def mapping(self, node: yaml.MappingNode, path: YamlPath) -> dict[str, Any]:
        result: dict[str, Any] = {}
        first_seen: dict[str, yaml.Node] = {}
        own: set[str] | None = None  # the mapping's own keys, needed only once a merge key comes
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.diagnostics.append(error(
                    "yaml_syntax", "a mapping key must be a plain name, not a list or mapping",
                    address=format_path(path),
                    range=SourceRange(self.filename, _pos(key_node.start_mark), _pos(key_node.end_mark))))
                continue
            if key_node.tag == _MERGE:
                if own is None:
                    own = {str(k.value) for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE}
                # The mapping's own keys win over merged ones wherever they are written.
                for merged_key, merged_value in self.merged(value_node, path):
                    key = str(merged_key.value)
                    if key not in own and key not in result:
                        if self.record:
                            self.key_marks[path + (key,)] = (_pos(merged_key.start_mark), _pos(merged_key.end_mark))
                        result[key] = self.build(merged_value, path + (key,))
                continue
            key = str(key_node.value)
            child = path + (key,)
            if key in first_seen:
                first = _pos(first_seen[key].start_mark)
                self.diagnostics.append(error(
                    "duplicate_key", f"duplicate key {key!r} in {format_path(path) or 'the top level'}",
                    f"{key!r} is first defined at line {first.line}, column {first.column}; "
                    "YAML parsers silently keep only one of them.",
                    address=format_path(child),
                    range=SourceRange(self.filename, _pos(key_node.start_mark), _pos(key_node.end_mark))))
                continue
            first_seen[key] = key_node
            if self.record:
                self.key_marks[child] = (_pos(key_node.start_mark), _pos(key_node.end_mark))
            result[key] = self.build(value_node, child)
        return result

    def merged(self, value: yaml.Node, path: YamlPath) -> list[Pair]:
        """The pairs a merge key (`<<: *base` or `<<: [*a, *b]`) brings in, as YAML's merge type
        has it: an earlier mapping wins over a later one, and each mapping's own keys over what it
        merged itself. Nodes are neither copied nor changed: an alias is still sized once, by
        _check_expansion, and counted as built, by build()."""
        sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
        out: dict[str, Pair] = {}
        for src in sources:
            if not isinstance(src, yaml.MappingNode) or src.tag not in _PLAIN_TAGS:
                self.diagnostics.append(error(
                    "yaml_syntax", "a merge key (<<) takes a mapping or a list of mappings",
                    "Write `<<: *name` where `&name` marks a mapping, or `<<: [*a, *b]`.",
                    address=format_path(path),
                    range=SourceRange(self.filename, _pos(src.start_mark), _pos(src.end_mark))))
                continue
            pairs = [(k, v) for k, v in src.value if isinstance(k, yaml.ScalarNode)]
            for k, v in pairs:
                if k.tag != _MERGE:
                    out.setdefault(str(k.value), (k, v))
            for k, v in pairs:
                if k.tag == _MERGE:
                    for pair in self.merged(v, path):
                        out.setdefault(str(pair[0].value), pair)
        return list(out.values())
