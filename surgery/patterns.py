r"""Source and target patterns: the small language every weight transform is written in.

A **source pattern** is a full Python regex, matched with :func:`re.search` against a
(scoped) checkpoint key, with two conveniences:

* ``*`` directly followed by ``.`` (or between two escaped dots, ``\.*\.``) is the *index
  wildcard*: it matches one index in
  its canonical spelling (``0`` or digits without a leading zero: ``experts.01`` is no expert)
  and gathers every key it matches under the same pattern, ordered by the index it captured
  (``mlp\.experts\.*\.w1\.weight``). Write ``.*\.`` when you mean the regex "anything, then a dot".
* ``.`` is the regex "any character", as always: ``experts.3Xw2`` matches ``experts.3.w2``.
  Escape the dots that separate key components (:func:`escape_dots` does it) so that only the
  canonical spelling of a key matches; the built-in catalog does.
* A pattern that ends in a letter or digit only matches at the end of a name, so
  ``q_proj.weight`` does not match ``q_proj.weight_scale``.

A **target pattern** is a replacement template: literal text (``\.`` is accepted for a dot),
``\1`` … ``\9`` for the source's capture groups, ``*`` for the wildcard's index. A leading ``^``
and look-around groups are kept only for the reverse direction, where the target becomes a
source again.

:func:`reverse_pair` turns a (source, target) pair around; it is how every transform derives its
inverse mechanically instead of having it written twice.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple

from .errors import PatternError

__all__ = [
    "STAR_GROUP_PREFIX",
    "SourcePattern",
    "TargetPattern",
    "compile_source",
    "escape_dots",
    "is_digit_blind",
    "lazy_compilation",
    "parse_target",
    "reverse_pair",
]

STAR_GROUP_PREFIX = "_star"
_NAME_BOUNDARY = r"(?![A-Za-z0-9_])"
_DIGITS = r"(?:0|[1-9][0-9]*)"  # canonical indices only (ASCII, no leading zero)
_BRACE_QUANT = re.compile(r"\{(?:\d+(?:,\d*)?|,\d+)\}\??")
_LAZY: ContextVar[bool] = ContextVar("surgery_lazy_regex_compilation", default=False)


# --------------------------------------------------------------------------- tokenizer


class _Tok(NamedTuple):  # a tuple, cheap to build: the catalog is tokenized at start-up (docs/benchmarks.md)
    kind: str  # literal, any, escape, class, open, close, quant, alt, anchor, star, backref
    text: str  # the source text of the token
    value: str = ""  # literal: the character; open: "capture" | "noncapture" | "look" | "named"


def _tokenize(pattern: str) -> list[_Tok]:
    """Split a regex into tokens precise enough to find groups, anchors and the wildcard."""
    toks: list[_Tok] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                raise PatternError(f"Pattern {pattern!r} ends with a lone backslash; escape it as '\\\\'.")
            nxt = pattern[i + 1]
            if nxt.isdigit():
                toks.append(_Tok("backref", pattern[i : i + 2], nxt))
            elif nxt in "AZbB":
                toks.append(_Tok("anchor", pattern[i : i + 2]))
            elif nxt.isalpha():
                toks.append(_Tok("escape", pattern[i : i + 2]))
            else:
                toks.append(_Tok("literal", pattern[i : i + 2], nxt))
            i += 2
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            if j >= n:
                raise PatternError(f"Pattern {pattern!r} has an unterminated character class at {i}.")
            toks.append(_Tok("class", pattern[i : j + 1]))
            i = j + 1
        elif c == "(":
            if pattern.startswith("(?:", i):
                toks.append(_Tok("open", "(?:", "noncapture"))
                i += 3
            elif pattern.startswith(("(?=", "(?!"), i):
                toks.append(_Tok("open", pattern[i : i + 3], "look"))
                i += 3
            elif pattern.startswith(("(?<=", "(?<!"), i):
                toks.append(_Tok("open", pattern[i : i + 4], "look"))
                i += 4
            elif pattern.startswith("(?P<", i):
                j = pattern.find(">", i)
                if j < 0:
                    raise PatternError(f"Pattern {pattern!r} has an unterminated group name at {i}.")
                toks.append(_Tok("open", pattern[i : j + 1], "capture"))
                i = j + 1
            elif pattern.startswith("(?", i):
                raise PatternError(
                    f"Pattern {pattern!r} uses the group syntax at {i} that surgery does not support; "
                    "use (...), (?:...), (?P<name>...) or a look-around."
                )
            else:
                toks.append(_Tok("open", "(", "capture"))
                i += 1
        elif c == ")":
            toks.append(_Tok("close", ")"))
            i += 1
        elif (
            c == "*"
            and not _after_quantifiable_any(toks)
            and (
                pattern.startswith(".", i + 1)
                # ``\.*\.``: between escaped dots (``.*\.`` stays the regex "anything, then a dot")
                or (pattern.startswith("\\.", i + 1) and bool(toks) and toks[-1].text == "\\.")
            )
        ):
            toks.append(_Tok("star", "*"))
            i += 1
        elif c in "*+?":
            j = i + 1
            if j < n and pattern[j] in "?+":
                j += 1
            toks.append(_Tok("quant", pattern[i:j]))
            i = j
        elif c == "{" and (brace := _BRACE_QUANT.match(pattern, i)) is not None:
            toks.append(_Tok("quant", brace.group(0)))
            i = brace.end()
        elif c == "|":
            toks.append(_Tok("alt", "|"))
            i += 1
        elif c in "^$":
            toks.append(_Tok("anchor", c))
            i += 1
        elif c == ".":
            toks.append(_Tok("any", "."))
            i += 1
        else:
            toks.append(_Tok("literal", c, c))
            i += 1
    return toks


def escape_dots(pattern: str) -> str:
    r"""``pattern`` with every ``.`` that is not quantified written ``\.``: dots separate key components.

    ``.*`` / ``.+`` / ``.?`` (the regex "any run") stay as they are, and so does the index
    wildcard: ``escape_dots("mlp.experts.*.w1.weight")`` is ``mlp\.experts\.*\.w1\.weight``,
    which matches ``mlp.experts.3.w1.weight`` and neither ``mlp.experts.3Xw1.weight`` nor
    ``mlp.experts.03.w1.weight``.

    Example:
        >>> escape_dots("layers.(\\d+).fc1") == r"layers\.(\d+)\.fc1"
        True
    """
    toks = _tokenize(pattern)
    out = []
    for i, tok in enumerate(toks):
        quantified = i + 1 < len(toks) and toks[i + 1].kind == "quant"
        out.append("\\." if tok.kind == "any" and not quantified else tok.text)
    return "".join(out)


def _after_quantifiable_any(toks: list[_Tok]) -> bool:
    """`.*.` keeps meaning "a dot-separated index" only when the `.` before `*` is a separator.

    A `*` after `)`, `]`, a class escape or another quantifier is a regex quantifier: `(a|b)*.`
    is "repeat the group". After `.` or a literal it is the index wildcard, as in
    ``experts.*.w1``.
    """
    if not toks:
        return False
    return toks[-1].kind in ("close", "class", "escape", "quant", "star")


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class SourcePattern:
    """A compiled source pattern.

    Attributes:
        text: the pattern as written.
        regex_text: the regex (wildcards turned into named digit groups, name boundary added);
            ``regex`` is it compiled.
        star_groups: regex group numbers of the index wildcards, in order.
        user_groups: regex group numbers of the user's own capture groups (``\\1`` is the first).
        anchored: whether the pattern starts with ``^``.
        digit_blind: whether the pattern provably treats every digit of a numeric key component
            (``layers.12.``) alike, so that keys differing only there match the same way (see
            :func:`is_digit_blind`).
    """

    text: str
    regex_text: str = field(repr=False)
    star_groups: tuple[int, ...] = field(repr=False)
    user_groups: tuple[int, ...] = field(repr=False)
    anchored: bool = field(repr=False)
    digit_blind: bool = field(repr=False, default=False)

    @functools.cached_property
    def regex(self) -> re.Pattern[str]:
        """The compiled regex (compiled on first use; :func:`compile_source` uses it at once).

        Raises:
            PatternError: the pattern is not a valid regex.
        """
        try:
            return re.compile(self.regex_text)
        except re.error as exc:
            raise PatternError(
                f"Source pattern {self.text!r} is not a valid regex: {exc}. Fix the pattern."
            ) from exc

    @property
    def has_star(self) -> bool:
        return bool(self.star_groups)

    def body(self) -> str:
        """The compiled regex text (wildcard groups and name boundary included)."""
        return self.regex_text


def compile_source(pattern: str) -> SourcePattern:
    """Compile a source pattern, or raise :class:`PatternError` naming it.

    The regex is compiled here, except inside :func:`lazy_compilation` (the installed catalogs
    load in it): there it is compiled on first use, so a catalog of a thousand patterns, most of
    which a given model never meets, registers without compiling them (a test compiles every
    catalog pattern). Results are shared per pattern text (a :class:`SourcePattern` is immutable).

    Example:
        >>> sp = compile_source("mlp.experts.*.w1.weight")
        >>> m = sp.regex.search("model.layers.0.mlp.experts.7.w1.weight")
        >>> m.group(sp.star_groups[0])
        '7'
    """
    if not isinstance(pattern, str) or not pattern:
        raise PatternError(f"A source pattern must be a non-empty string, got {pattern!r}.")
    source = _parse_source(pattern)
    if not _LAZY.get():
        source.regex  # noqa: B018 (compiled now: an invalid regex is refused where it is written)
    return source


@functools.lru_cache(maxsize=4096)
def _parse_source(pattern: str) -> SourcePattern:
    toks = _tokenize(pattern)
    parts: list[str] = []
    star_groups: list[int] = []
    user_groups: list[int] = []
    group_no = 0
    n_star = 0
    for tok in toks:
        if tok.kind == "star":
            group_no += 1
            star_groups.append(group_no)
            parts.append(f"(?P<{STAR_GROUP_PREFIX}{n_star}>{_DIGITS})")
            n_star += 1
            continue
        if tok.kind == "open" and tok.value == "capture":
            group_no += 1
            user_groups.append(group_no)
        if tok.kind == "backref":
            raise PatternError(
                f"Source pattern {pattern!r} uses the back-reference {tok.text!r}; back-references "
                "inside a source are not supported (a key must be matched by what it contains, not "
                "by repetition). Match the repeated text explicitly."
            )
        parts.append(tok.text)
    text = "".join(parts)
    if toks and toks[-1].kind in ("literal", "any") and re.search(r"[A-Za-z0-9]$", pattern):
        text += _NAME_BOUNDARY
    anchored = bool(toks) and toks[0].kind == "anchor" and toks[0].text == "^"
    return SourcePattern(pattern, text, tuple(star_groups), tuple(user_groups), anchored, _digit_blind(toks))


@contextlib.contextmanager
def lazy_compilation() -> Iterator[None]:
    """Within the block (in this thread or task), :func:`compile_source` leaves the regex to its first use.

    The registry loads the installed catalogs inside it. A pattern that turns out not to be a
    valid regex then raises :class:`PatternError`, naming it, where it is first matched.

    Example:
        >>> with lazy_compilation():
        ...     sp = compile_source("layers.*.mlp")
        >>> sp.regex.search("layers.3.mlp") is not None
        True
    """
    token = _LAZY.set(True)
    try:
        yield
    finally:
        _LAZY.reset(token)


def is_digit_blind(pattern: str) -> bool:
    """Whether a source pattern cannot tell one digit of a numeric key component from another.

    A *numeric component* is a dotted component made of digits only (the ``12`` of
    ``layers.12.mlp``). The pattern is digit-blind when every piece of it that could meet such a
    digit accepts all ten digits alike: ``\\d``, ``.``, ``\\w``, the ``*`` wildcard and the name
    boundary do; a literal digit does only when a literal letter (or ``_``) stands right beside
    it, which keeps it out of numeric components (the ``1`` of ``w1``). Character classes that
    mention a digit, ``\\N{...}`` escapes and any other literal digit make the answer ``False``
    (conservative: some of those are blind too). Quantifier counts (``{2}``) do not matter.

    Keys that differ only in the digits of their numeric components, with the same widths, are
    then matched at the same positions, by the same alternatives; :mod:`surgery.routing` relies on
    this to reuse one key's routing for its siblings.

    Example:
        >>> is_digit_blind("experts.*.w1.weight"), is_digit_blind("layers.0.weight")
        (True, False)
    """
    return compile_source(pattern).digit_blind


def _digit_blind(toks: list[_Tok]) -> bool:
    def is_digit(k: int) -> bool:
        return 0 <= k < len(toks) and toks[k].kind == "literal" and toks[k].value in _ASCII_DIGITS

    def glued_letter(k: int) -> bool:  # an unquantified literal letter or "_" at k
        if not (0 <= k < len(toks) and toks[k].kind == "literal" and _is_word_char(toks[k].value)):
            return False
        return not (k + 1 < len(toks) and toks[k + 1].kind == "quant")

    i = 0
    while i < len(toks):
        tok = toks[i]
        if is_digit(i):
            # A run of literal digits is safe when a literal letter is glued to it: the key
            # component it matches then holds a letter, so it is not numeric (the 1 of "w1").
            j = i
            while is_digit(j + 1):
                j += 1
            if not (glued_letter(i - 1) or glued_letter(j + 1)):
                return False
            i = j + 1
            continue
        if tok.kind == "class" and (any(c in _ASCII_DIGITS for c in tok.text) or "\\N" in tok.text):
            return False
        if tok.kind == "escape" and tok.text == "\\N":
            return False
        i += 1
    return True


_ASCII_DIGITS = frozenset("0123456789")


def _is_word_char(c: str) -> bool:
    return c == "_" or (c.isascii() and c.isalpha())


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class TargetPattern:
    """A parsed target template.

    ``pieces`` alternates literal strings and references: ``("ref", k)`` for ``\\k`` and
    ``("star", i)`` for the i-th ``*``.
    """

    text: str
    pieces: tuple[str | tuple[str, int], ...]
    anchored: bool
    lookarounds: tuple[tuple[int, str], ...]  # (position in pieces, look-around text), reverse only

    @property
    def n_stars(self) -> int:
        return sum(1 for p in self.pieces if isinstance(p, tuple) and p[0] == "star")

    @property
    def max_ref(self) -> int:
        return max((p[1] for p in self.pieces if isinstance(p, tuple) and p[0] == "ref"), default=0)

    @property
    def literal(self) -> str | None:
        """The target as plain text when it has no references and no wildcard."""
        if all(isinstance(p, str) for p in self.pieces):
            return "".join(p for p in self.pieces if isinstance(p, str))
        return None

    def locate(self, key: str) -> tuple[str, tuple[str, ...], tuple[str, ...] | None, str] | None:
        """Find this template inside ``key`` (its last occurrence): ``(prefix, groups, stars, suffix)``.

        ``stars`` is ``None`` when the key still holds a ``*``. ``None`` when the key does not
        contain the template at all.
        """
        parts: list[str] = []
        refs: list[tuple[str, int]] = []
        for piece in self.pieces:
            if isinstance(piece, str):
                parts.append(re.escape(piece))
            elif piece[0] == "ref":
                parts.append(f"(?P<r{len(refs)}>.*?)")
                refs.append(piece)
            else:
                parts.append(rf"(?P<r{len(refs)}>\d+|\*)")
                refs.append(piece)
        found = list(re.finditer("".join(parts), key))
        if not found:
            return None
        m = found[-1]  # the last occurrence: targets are leaf names
        groups: dict[int, str] = {}
        stars: list[str] = []
        for i, (kind, n) in enumerate(refs):
            if kind == "ref":
                groups[n] = m.group(f"r{i}")
            else:
                stars.append(m.group(f"r{i}"))
        group_tuple = tuple(groups.get(i + 1, "") for i in range(max(groups, default=0)))
        star_vals = tuple(stars) if stars and all(s != "*" for s in stars) else None
        return key[: m.start()], group_tuple, star_vals, key[m.end() :]

    def expand(self, groups: tuple[str, ...] = (), stars: tuple[str, ...] | None = None) -> str:
        """Fill references with ``groups`` (``\\1`` is ``groups[0]``) and wildcards with ``stars``.

        A wildcard with no value stays ``*`` (the op chain fills it later).
        """
        out: list[str] = []
        for p in self.pieces:
            if isinstance(p, str):
                out.append(p)
            elif p[0] == "ref":
                out.append(groups[p[1] - 1])
            else:
                out.append(stars[p[1]] if stars is not None and p[1] < len(stars) else "*")
        return "".join(out)


def parse_target(pattern: str) -> TargetPattern:
    """Parse a target template, or raise :class:`PatternError` naming it."""
    if not isinstance(pattern, str):
        raise PatternError(f"A target pattern must be a string, got {pattern!r}.")
    pieces: list[str | tuple[str, int]] = []
    looks: list[tuple[int, str]] = []
    buf: list[str] = []
    anchored = pattern.startswith("^")
    i = 1 if anchored else 0
    n = len(pattern)
    n_star = 0

    def flush() -> None:
        if buf:
            pieces.append("".join(buf))
            buf.clear()

    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                raise PatternError(f"Target pattern {pattern!r} ends with a lone backslash.")
            nxt = pattern[i + 1]
            if nxt.isdigit() and nxt != "0":
                flush()
                pieces.append(("ref", int(nxt)))
            elif nxt.isalnum():
                raise PatternError(
                    f"Target pattern {pattern!r} contains {pattern[i : i + 2]!r}; targets are plain text "
                    "with \\1..\\9 references, '*' for the index and '\\.' for a dot."
                )
            else:
                buf.append(nxt)
            i += 2
        elif c == "*":
            flush()
            pieces.append(("star", n_star))
            n_star += 1
            i += 1
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            depth, j = 0, i
            while j < n:
                if pattern[j] == "\\":
                    j += 2
                    continue
                if pattern[j] == "(":
                    depth += 1
                elif pattern[j] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            flush()
            looks.append((len(pieces), pattern[i : j + 1]))
            i = j + 1
        elif c in "()[]|+?{}$^":
            raise PatternError(
                f"Target pattern {pattern!r} contains the regex character {c!r} at {i}; a target is "
                "a replacement template. Put variable parts in a capture group of the source and "
                "refer to them with \\1..\\9."
            )
        else:
            buf.append(c)
            i += 1
    flush()
    return TargetPattern(pattern, tuple(pieces), anchored, tuple(looks))


# --------------------------------------------------------------------------- reversal


def _group_texts(toks: list[_Tok]) -> dict[int, str]:
    """Map each user capture group (1-based, stars excluded) to its inner regex text."""
    texts: dict[int, str] = {}
    stack: list[tuple[int | None, int]] = []  # (user group number or None, token index)
    user_no = 0
    for idx, tok in enumerate(toks):
        if tok.kind == "open":
            if tok.value == "capture":
                user_no += 1
                stack.append((user_no, idx))
            else:
                stack.append((None, idx))
        elif tok.kind == "close" and stack:
            num, start = stack.pop()
            if num is not None:
                inner = toks[start + 1 : idx]
                texts[num] = "".join(_noncapturing(t) for t in inner)
    return texts


def _noncapturing(tok: _Tok) -> str:
    if tok.kind == "open" and tok.value == "capture":
        return "(?:"
    if tok.kind == "star":
        return "*"
    return tok.text


def reverse_pair(source: str, target: str) -> tuple[str, str]:
    """Turn a (source regex, target template) pair into its inverse pair.

    The target becomes a regex (literal text escaped, ``\\k`` becomes the text of the source's
    group k as a new capture group, ``*`` the wildcard, look-arounds kept); the source becomes a
    template (literal text kept, anchors dropped, capture groups become back-references,
    look-arounds kept verbatim: a template ignores them when it expands, and they are restored
    when the pair is reversed again).

    Raises:
        PatternError: when the source has parts that the target does not keep (a quantified
            literal, a class or an alternation outside any capture group, or a group the target
            never references), since the original key could not be rebuilt from the target.

    Example:
        >>> reverse_pair(r"^(?!model\\.)(.+)", r"model.\\1")
        ('^model\\\\.(.+)', '(?!model\\\\.)\\\\1')
        >>> parse_target(_[1]).expand(("layers.0.weight",))
        'layers.0.weight'
    """
    src_toks = _tokenize(source)
    tgt = parse_target(target)
    group_texts = _group_texts(src_toks)
    anchored = (bool(src_toks) and src_toks[0].kind == "anchor" and src_toks[0].text == "^") or tgt.anchored

    # New source: the target as a regex.
    new_src: list[str] = ["^"] if anchored else []
    new_group_of_old: dict[int, int] = {}
    new_group_no = 0
    looks: dict[int, str] = {}  # position -> look-arounds there, stacked ones kept in order
    for pos, text in tgt.lookarounds:
        looks[pos] = looks.get(pos, "") + text
    after_star = False
    for pos, piece in enumerate(tgt.pieces):
        if pos in looks:
            new_src.append(_without_captures(looks[pos]))
        if after_star and not (isinstance(piece, str) and piece.startswith(".") and pos not in looks):
            raise PatternError(
                f"Cannot reverse ({source!r} -> {target!r}): the '*' of the target must be followed by "
                "'.', as in 'experts.*.weight', so that it reads as the index wildcard again."
            )
        if isinstance(piece, str):
            # Right after a wildcard the dot stays unescaped: '*.' is how a source spells the wildcard.
            new_src.append("." + _escape_literal(piece[1:]) if after_star else _escape_literal(piece))
            after_star = False
        elif piece[0] == "star":
            if pos and isinstance(tgt.pieces[pos - 1], tuple):
                raise PatternError(
                    f"Cannot reverse ({source!r} -> {target!r}): a '*' right after a reference or another "
                    "'*' would read as a regex quantifier; put a literal '.' between them."
                )
            new_src.append("*")
            after_star = True
        else:
            k = piece[1]
            if k not in group_texts:
                raise PatternError(
                    f"Target {target!r} refers to \\{k}, but source {source!r} has only "
                    f"{len(group_texts)} capture group(s)."
                )
            new_group_no += 1
            new_group_of_old.setdefault(k, new_group_no)
            new_src.append(f"({group_texts[k]})")
    if after_star:
        raise PatternError(
            f"Cannot reverse ({source!r} -> {target!r}): the target ends with '*'; a wildcard must be "
            "followed by '.', as in 'experts.*.weight'."
        )
    if len(tgt.pieces) in looks:
        new_src.append(_without_captures(looks[len(tgt.pieces)]))

    # New target: the source as a template. Look-arounds are kept verbatim: a template ignores
    # them, and they come back as look-arounds when the pair is reversed again.
    out: list[str] = []
    depth_skip = 0  # inside a look-around or a captured group: skip tokens
    look: list[str] | None = None  # the text of the look-around being skipped
    user_no = 0
    for tok in src_toks:
        if depth_skip:
            if look is not None:
                look.append(tok.text)
            if tok.kind == "open":
                if tok.value == "capture":
                    user_no += 1
                depth_skip += 1
            elif tok.kind == "close":
                depth_skip -= 1
                if not depth_skip and look is not None:
                    out.append("".join(look))
                    look = None
            continue
        if tok.kind == "anchor":
            continue
        if tok.kind == "open" and tok.value == "look":
            depth_skip = 1
            look = [tok.text]
            continue
        if tok.kind == "open" and tok.value == "capture":
            user_no += 1
            if user_no not in new_group_of_old:
                raise PatternError(
                    f"Cannot reverse ({source!r} -> {target!r}): group \\{user_no} of the source is "
                    "not used in the target, so the original key could not be rebuilt. Refer to it "
                    "in the target or make it a look-around."
                )
            out.append(f"\\{new_group_of_old[user_no]}")
            depth_skip = 1
            continue
        if tok.kind == "star":
            out.append("*")
        elif tok.kind == "literal":
            out.append(tok.value if tok.value != "." else r"\.")
        elif tok.kind == "any":
            out.append(r"\.")
        else:
            raise PatternError(
                f"Cannot reverse source {source!r}: {tok.text!r} matches variable text outside a "
                "capture group, so the original key could not be rebuilt. Wrap it in a capture "
                "group and refer to it from the target."
            )
    return "".join(new_src), "".join(out)


def _without_captures(regex: str) -> str:
    """``regex`` with its capture groups made non-capturing, so they do not shift group numbers."""
    return "".join(_noncapturing(t) for t in _tokenize(regex))


def _escape_literal(text: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?{}[]\\|()" else ch for ch in text)
