#!/usr/bin/env python3
"""The import checker: no circle of files, no arrow back up.

Builds the file-level import graph of `crates/core/src` (the crate
`weightcast_core`), `src/` (the library `weightcast`) and `src/bin/weightcast`
(the binary) from the code's own imports, and reports

  (a) every circle of files: each strongly connected component of more than
      one file, as the edges that close it;
  (b) every arrow back up: an edge from a file to a file of a higher layer
      (or to a sibling the layer table does not allow), per LAYERS below.

An edge A -> B (item) means: file A names `item`, which file B defines. Every
`use` declaration and every inline path (`crate::…`, `super::…`, `self::…`,
`weightcast_core::…`, a submodule's or an imported module's name followed by
`::`) is resolved, through `pub use` re-exports and module aliases, to the
file that defines the item (a `fn`, type, trait, `const`, `static` or macro).
Naming a module is not an edge; naming an item through it is.

  * A re-export (a `use` with a visibility: `pub`, `pub(crate)`, …) is not an
    edge by itself: a facade `mod.rs` that re-exports its children's items
    does not depend on them. It is an edge when the file also names the item
    in its own code.
  * A file that uses an item defined in its parent module's file has an edge
    to that file (so a parent that also uses its child makes a circle).
  * Paths from `src/` into `weightcast_core::` (or through the library's
    re-exports of its modules, `crate::codec::…`) are edges to core files.
  * Test code is left out: `#[cfg(test)]` items and modules (and the files
    they declare). Tests may reach across layers; the layers are about the
    code that ships.
  * Comments, doc links and string literals are not imports.

Usage:
  check_imports.py [--root DIR] [--allow FILE] [--graph] [--self-test]

`--allow FILE` lists edges (`A -> B`, one per line, `#` comments) that are
known violations being fixed elsewhere: they are reported as pending and do
not fail the check. An allowance into or out of `crates/core/src` is refused,
and so is an allowance that no longer matches an edge (remove it).

Exits 0 when there is no violation, 1 when there is (each printed as
`A -> B (item)`), 2 on a usage or allowance error. Python 3.11, stdlib only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------------------
# The layer table.
#
# Each unit is a path prefix (longest prefix wins) with a rank. An edge may
# go to a unit of the same or a lower rank; to a higher rank it is an arrow
# back up. Two different units of the same rank are siblings and may not
# import each other at all, except for the pairs in SIBLINGS_ALLOWED.
# Within one unit only circles are checked.

LAYERS: list[tuple[str, str, int]] = [
    # weightcast-core (crates/core/src): the format, then the codec.
    ("crates/core/src/error.rs", "core:error", 0),
    ("crates/core/src/dtype.rs", "core:dtype", 1),
    ("crates/core/src/platform.rs", "core:platform", 2),
    ("crates/core/src/digest.rs", "core:digest", 3),
    ("crates/core/src/tensors.rs", "core:tensors", 4),
    ("crates/core/src/format.rs", "core:format", 5),
    # The codec, bottom to top: bit streams and the diff scan; the compact
    # encoding (its AVX-512 kernels in compact/vector.rs); what every object
    # header is made of; the TRL and planes encodings; anchor objects; delta
    # parsing; the apply strategies; delta encoding. codec/mod.rs is a facade
    # and sits on top.
    ("crates/core/src/codec/bits.rs", "core:codec/bits", 10),
    ("crates/core/src/codec/scan.rs", "core:codec/scan", 11),
    ("crates/core/src/codec/compact/", "core:codec/compact", 12),
    ("crates/core/src/codec/header.rs", "core:codec/header", 13),
    ("crates/core/src/codec/trl.rs", "core:codec/trl", 14),
    ("crates/core/src/codec/planes/", "core:codec/planes", 15),
    ("crates/core/src/codec/anchor/", "core:codec/anchor", 16),
    ("crates/core/src/codec/parse.rs", "core:codec/parse", 17),
    ("crates/core/src/codec/apply/", "core:codec/apply", 18),
    ("crates/core/src/codec/encode.rs", "core:codec/encode", 19),
    ("crates/core/src/codec/mod.rs", "core:codec", 20),
    ("crates/core/src/generator.rs", "core:generator", 30),
    ("crates/core/src/bench.rs", "core:bench", 31),
    ("crates/core/src/lib.rs", "core:lib", 39),
    # weightcast (src/): the re-exported core, then the bucket, the protocol,
    # notifications, the roles, the engine hand-off, the daemons' HTTP, the
    # demo, the binary.
    ("src/failpoint.rs", "failpoint", 40),
    ("src/fsio.rs", "fsio", 40),
    ("src/store/", "store", 41),
    ("src/protocol/", "protocol", 42),
    ("src/notify.rs", "notify", 43),
    ("src/publisher/", "publisher", 50),
    ("src/subscriber/", "subscriber", 50),
    ("src/relay.rs", "relay", 50),
    # The engine hand-off: a leaf (it imports only the error type) that the
    # subscriber daemon and the Python binding call after each version.
    ("src/hooks.rs", "hooks", 44),
    ("src/http/", "http", 52),
    ("src/demo.rs", "demo", 53),
    ("src/lib.rs", "lib", 59),
    ("src/bin/", "bin", 60),
]

# Sibling units (same rank) that may import each other, and why. The roles
# are independent: a subscriber does not need a publisher, nor the reverse.
SIBLINGS_ALLOWED: dict[tuple[str, str], str] = {
    ("relay", "subscriber"): (
        "a relay follows its origin as a subscriber does, with the subscriber's "
        "version source and fetcher (docs/architecture.md, \"Subscriber\": the relay "
        "is a composition of the subscriber's parts)"
    ),
}

CRATES = [
    # (name, root file, name other crates use for it)
    ("weightcast_core", "crates/core/src/lib.rs"),
    ("weightcast", "src/lib.rs"),
    ("weightcast_bin", "src/bin/weightcast/main.rs"),
]
# Which crates each crate may name (its dependencies).
DEPENDS = {
    "weightcast_core": [],
    "weightcast": ["weightcast_core"],
    "weightcast_bin": ["weightcast", "weightcast_core"],
}

ITEM_KEYWORDS = {"fn", "struct", "enum", "trait", "type", "const", "static", "union"}

# ---------------------------------------------------------------------------
# Lexer: identifiers, `::`, punctuation; comments, strings and chars dropped.


def lex(src: str) -> list[str]:
    toks: list[str] = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c.isspace():
            i += 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c in "rbc" and _raw_or_prefixed_string(src, i):
            i = _skip_prefixed_string(src, i)
            toks.append('""')
        elif c == '"':
            i = _skip_string(src, i + 1)
            toks.append('""')
        elif c == "'":
            if i + 1 < n and src[i + 1] == "\\":
                j = src.find("'", i + 2)
                while j > 0 and src[j - 1] == "\\" and src[j - 2] != "\\":
                    j = src.find("'", j + 1)
                i = j + 1
                toks.append("''")
            elif i + 2 < n and src[i + 2] == "'":
                i += 3
                toks.append("''")
            else:  # a lifetime or label
                j = i + 1
                while j < n and (src[j].isalnum() or src[j] == "_"):
                    j += 1
                toks.append("'" + src[i + 1 : j])
                i = j
        elif c.isalpha() or c == "_":
            j = i + 1
            while j < n and (src[j].isalnum() or src[j] == "_"):
                j += 1
            word = src[i:j]
            if word == "r" and j < n and src[j] == "#":  # raw identifier r#name
                k = j + 1
                while k < n and (src[k].isalnum() or src[k] == "_"):
                    k += 1
                word, j = src[j + 1 : k], k
            toks.append(word)
            i = j
        elif c.isdigit():
            j = i + 1
            while j < n and (src[j].isalnum() or src[j] == "_"):
                j += 1
            if j + 1 < n and src[j] == "." and src[j + 1].isdigit():
                j += 1
                while j < n and (src[j].isalnum() or src[j] == "_"):
                    j += 1
            toks.append("0")
            i = j
        elif src.startswith("::", i):
            toks.append("::")
            i += 2
        elif c == "$" and src.startswith("$crate", i):
            toks.append("crate")
            i += 6
        else:
            toks.append(c)
            i += 1
    return toks


def _raw_or_prefixed_string(src: str, i: int) -> bool:
    if i > 0 and (src[i - 1].isalnum() or src[i - 1] == "_"):
        return False
    for p in ("br", "cr", "r", "b", "c"):
        if src.startswith(p, i):
            j = i + len(p)
            if "r" in p:
                while j < len(src) and src[j] == "#":
                    j += 1
            if j < len(src) and src[j] == '"':
                return True
            if p == "b" and j < len(src) and src[j] == "'":
                return True
    return False


def _skip_prefixed_string(src: str, i: int) -> int:
    for p in ("br", "cr", "r", "b", "c"):
        if src.startswith(p, i):
            j = i + len(p)
            break
    if src[j] == "'":  # byte char b'x'
        if src[j + 1] == "\\":
            return src.find("'", j + 3) + 1
        return j + 3
    if "r" in src[i:j]:
        hashes = 0
        while src[j] == "#":
            hashes, j = hashes + 1, j + 1
        end = src.find('"' + "#" * hashes, j + 1)
        return end + 1 + hashes
    return _skip_string(src, j + 1)


def _skip_string(src: str, i: int) -> int:
    while i < len(src):
        if src[i] == "\\":
            i += 2
        elif src[i] == '"':
            return i + 1
        else:
            i += 1
    return i


# ---------------------------------------------------------------------------
# The module tree.


@dataclass
class Use:
    segs: list[str]
    alias: str | None  # the name it binds (None for a glob)
    glob: bool
    reexport: bool  # has a visibility: not an edge by itself
    module: "Module"  # where it is declared (resolution starts there)
    file: str


@dataclass
class Module:
    crate: str
    path: str  # crate::a::b
    file: str  # the file holding its items (for inline modules, the parent's)
    parent: "Module | None"
    submods: dict[str, "Module"] = field(default_factory=dict)
    items: dict[str, str] = field(default_factory=dict)  # name -> defining file
    imports: dict[str, Use] = field(default_factory=dict)
    globs: list[Use] = field(default_factory=list)


@dataclass
class FileInfo:
    path: str
    module: Module
    uses: list[Use] = field(default_factory=list)
    paths: list[tuple[Module, list[str]]] = field(default_factory=list)
    idents: set[str] = field(default_factory=set)  # named outside `use`


class Tree:
    def __init__(self, root: Path):
        self.root = root
        self.crates: dict[str, Module] = {}
        self.files: dict[str, FileInfo] = {}
        self.errors: list[str] = []
        for name, rel in CRATES:
            if (root / rel).is_file():
                m = Module(name, "crate", rel, None)
                self.crates[name] = m
                self.load(m, rel, is_root=True)

    # -- loading ----------------------------------------------------------

    def load(self, module: Module, rel: str, is_root: bool) -> None:
        text = (self.root / rel).read_text(encoding="utf-8")
        info = FileInfo(rel, module)
        self.files[rel] = info
        toks = lex(text)
        Parser(self, info, toks, rel, is_root).run()

    def child_file(self, parent_rel: str, is_dir_owner: bool, name: str) -> str | None:
        p = Path(parent_rel)
        base = p.parent if is_dir_owner else p.parent / p.stem
        for cand in (base / f"{name}.rs", base / name / "mod.rs"):
            if (self.root / cand).is_file():
                return cand.as_posix()
        return None

    # -- resolution -------------------------------------------------------

    def resolve(self, mod: Module, segs: list[str], seen=None):
        """What `segs`, named in `mod`, stands for: ("item", file, name),
        ("module", Module), or None (another crate, or not found)."""
        if not segs:
            return None
        seen = set() if seen is None else seen
        first = segs[0]
        if first == "crate":
            return self.walk(self.crates[mod.crate], segs[1:], seen)
        if first == "self":
            return self.walk(mod, segs[1:], seen)
        if first == "super":
            cur, rest = mod.parent, segs[1:]
            while rest and rest[0] == "super" and cur is not None:
                cur, rest = cur.parent, rest[1:]
            return None if cur is None else self.walk(cur, rest, seen)
        if first in DEPENDS.get(mod.crate, []) and first in self.crates:
            return self.walk(self.crates[first], segs[1:], seen)
        return self.walk(mod, segs, seen)

    def walk(self, cur: Module, rest: list[str], seen):
        if not rest:
            return ("module", cur)
        name = rest[0]
        key = (cur.path, cur.crate, tuple(rest))
        if key in seen:
            return None
        seen = seen | {key}
        # A module and an item may share a name (a module `apply` and a
        # re-exported `fn apply`): a path's last segment names the item, an
        # inner one the module.
        last = len(rest) == 1
        if name in cur.submods and not (last and (name in cur.items or name in cur.imports)):
            return self.walk(cur.submods[name], rest[1:], seen)
        if name in cur.items:
            return ("item", cur.items[name], name)
        u = cur.imports.get(name)
        if u is not None:
            target = self.resolve(u.module, u.segs, seen)
            if target is None:
                return None
            if target[0] == "module":
                return self.walk(target[1], rest[1:], seen)
            return target
        if name in cur.submods:
            return self.walk(cur.submods[name], rest[1:], seen)
        for g in cur.globs:
            target = self.resolve(g.module, g.segs, seen)
            if target is not None and target[0] == "module":
                r = self.walk(target[1], rest, seen)
                if r is not None:
                    return r
        return None

    # -- the graph --------------------------------------------------------

    def edges(self) -> dict[tuple[str, str], set[str]]:
        out: dict[tuple[str, str], set[str]] = {}

        def add(a: str, target, what: str) -> None:
            if target is None or target[0] != "item":
                return
            b = target[1]
            if a != b:
                out.setdefault((a, b), set()).add(what)

        for rel, info in self.files.items():
            for u in info.uses:
                if u.glob:
                    continue
                if u.reexport and (u.alias is None or u.alias not in info.idents):
                    continue
                add(rel, self.resolve(u.module, u.segs), u.segs[-1])
            for mod, segs in info.paths:
                # The shortest prefix that names an item (what follows it is
                # the item's own: a method, a variant, an associated const).
                for k in range(1, len(segs) + 1):
                    t = self.resolve(mod, segs[:k])
                    if t is None or t[0] == "item":
                        add(rel, t, "::".join(segs[:k]))
                        break
        return out


class Parser:
    """One pass over a file's tokens: modules, items, `use` trees, paths."""

    def __init__(self, tree: Tree, info: FileInfo, toks: list[str], rel: str, is_root: bool):
        self.tree, self.info, self.t, self.rel = tree, info, toks, rel
        self.dir_owner = is_root or rel.endswith("/mod.rs")
        self.i = 0

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.t[j] if j < len(self.t) else ""

    def run(self) -> None:
        self.block(self.info.module, module_level=True, end=None, test=False)

    def block(self, mod: Module, module_level: bool, end: str | None, test: bool) -> None:
        """Tokens up to the matching `end` (None: end of file)."""
        attrs_test = False
        attrs_export = False
        prev = ""
        while self.i < len(self.t):
            tok = self.peek()
            if tok == end:
                self.i += 1
                return
            if tok == "#":  # attribute
                j = self.i + 1
                if self.peek(1) == "!":
                    j += 1
                if j < len(self.t) and self.t[j] == "[":
                    k, depth = j, 0
                    while k < len(self.t):
                        if self.t[k] == "[":
                            depth += 1
                        elif self.t[k] == "]":
                            depth -= 1
                            if depth == 0:
                                break
                        k += 1
                    body = self.t[j + 1 : k]
                    if body[:3] == ["cfg", "(", "test"] and body[3:4] == [")"]:
                        attrs_test = True
                    if body[:1] == ["macro_export"]:
                        attrs_export = True
                    self.i = k + 1
                    continue
            item_test = test or attrs_test
            # Visibility.
            vis = False
            if tok == "pub":
                vis = True
                self.i += 1
                if self.peek() == "(":
                    self.skip_group("(", ")")
                tok = self.peek()
            if tok == "use":
                self.i += 1
                trees = self.use_tree([])
                if not item_test:
                    for segs, alias, glob in trees:
                        u = Use(segs, alias, glob, vis and module_level, mod, self.rel)
                        self.info.uses.append(u)
                if not item_test:
                    # Imports inside a body are registered in the enclosing
                    # module too (a slight widening of their scope): paths
                    # through them must resolve.
                    for segs, alias, glob in trees:
                        u = Use(segs, alias, glob, vis, mod, self.rel)
                        if glob:
                            mod.globs.append(u)
                        elif alias:
                            mod.imports.setdefault(alias, u)
                attrs_test = attrs_export = False
                prev = ";"
                continue
            if tok == "mod" and module_level and self.peek(2) in (";", "{"):
                name = self.peek(1)
                self.i += 2
                if self.peek() == ";":
                    self.i += 1
                    if not item_test:
                        rel = self.tree.child_file(self.rel, self.dir_owner, name)
                        if rel is None:
                            self.tree.errors.append(f"{self.rel}: module `{name}`: no file")
                        else:
                            sub = Module(mod.crate, f"{mod.path}::{name}", rel, mod)
                            mod.submods[name] = sub
                            self.tree.load(sub, rel, is_root=False)
                else:
                    self.i += 1
                    sub = Module(mod.crate, f"{mod.path}::{name}", self.rel, mod)
                    if not item_test:
                        mod.submods[name] = sub
                    self.block(sub, module_level=True, end="}", test=item_test)
                attrs_test = attrs_export = False
                prev = "}"
                continue
            if module_level and tok == "macro_rules" and self.peek(1) == "!":
                name = self.peek(2)
                if not item_test:
                    mod.items[name] = self.rel
                    if attrs_export:
                        self.tree.crates[mod.crate].items.setdefault(name, self.rel)
                self.i += 3
                attrs_test = attrs_export = False
                self.item_rest(mod, item_test)
                continue
            if module_level and tok in ITEM_KEYWORDS or (
                module_level and tok in ("async", "unsafe", "extern") and self.fn_ahead()
            ):
                kw_at = self.i
                while self.peek() in ("async", "unsafe", "extern", "const") and self.peek(
                    1
                ) in ITEM_KEYWORDS | {"async", "unsafe", "extern", '""'}:
                    self.i += 1
                    if self.peek() == '""':
                        self.i += 1
                name = self.peek(1)
                if name and (name[0].isalpha() or name[0] == "_") and name != "_":
                    if not item_test:
                        mod.items.setdefault(name, self.rel)
                self.i = max(self.i, kw_at)
                attrs_test = attrs_export = False
                self.item_rest(mod, item_test)
                continue
            if attrs_test or (vis and not module_level):
                # A test-only (or visible) thing inside a block: an impl item.
                attrs_test = attrs_export = False
                self.item_rest(mod, item_test)
                continue
            attrs_test = attrs_export = False
            # Anything else: scan, with nesting.
            if tok == "{":
                self.i += 1
                self.block(mod, module_level=False, end="}", test=test)
                prev = "}"
                continue
            self.scan_token(mod, test, prev)
            prev = tok

    def fn_ahead(self) -> bool:
        for k in range(1, 5):
            if self.peek(k) in ITEM_KEYWORDS:
                return True
        return False

    def item_rest(self, mod: Module, test: bool) -> None:
        """The rest of an item: up to `;` at its own depth, or its closing
        `}` (a body, scanned for `use`s and paths)."""
        depth = 0
        prev = ""
        while self.i < len(self.t):
            tok = self.peek()
            if tok in "([" and tok:
                depth += 1
            elif tok in ")]" and tok:
                depth -= 1
            elif tok == ";" and depth == 0:
                self.i += 1
                return
            elif tok == "{" and depth == 0:
                self.i += 1
                self.block(mod, module_level=False, end="}", test=test)
                # `struct S { .. }` and `fn f() { .. }` end here; a `;`
                # after (a `const` with a struct value) is harmless.
                return
            elif tok == "}" and depth == 0:
                return  # a malformed item: let the caller close its block
            if tok == "{":
                self.i += 1
                self.block(mod, module_level=False, end="}", test=test)
                prev = "}"
                continue
            self.scan_token(mod, test, prev)
            prev = tok

    def scan_token(self, mod: Module, test: bool, prev: str) -> None:
        tok = self.peek()
        if tok == "use":  # a `use` inside a body (the keyword after `pub(…)`)
            self.i += 1
            trees = self.use_tree([])
            if not test:
                for segs, alias, glob in trees:
                    u = Use(segs, alias, glob, False, mod, self.rel)
                    self.info.uses.append(u)
                    if alias and not glob:
                        mod.imports.setdefault(alias, u)
            return
        is_ident = tok[:1].isalpha() or tok[:1] == "_"
        if is_ident and prev != "::" and prev != "." and not test:
            self.info.idents.add(tok)
            if self.peek(1) == "::" and self.peek(2)[:1].isalpha() or (
                self.peek(1) == "::" and self.peek(2)[:1] == "_"
            ):
                segs = [tok]
                j = self.i + 1
                while j + 1 < len(self.t) and self.t[j] == "::":
                    nxt = self.t[j + 1]
                    if not (nxt[:1].isalpha() or nxt[:1] == "_"):
                        break
                    segs.append(nxt)
                    j += 2
                self.info.paths.append((mod, segs))
                self.i = j
                return
        self.i += 1

    def skip_group(self, open_: str, close: str) -> None:
        depth = 0
        while self.i < len(self.t):
            tok = self.peek()
            self.i += 1
            if tok == open_:
                depth += 1
            elif tok == close:
                depth -= 1
                if depth == 0:
                    return

    def use_tree(self, prefix: list[str]) -> list[tuple[list[str], str | None, bool]]:
        """Parses a use tree up to `;` (top level) or the end of a group;
        returns (segments, bound name, glob) for each leaf."""
        out: list[tuple[list[str], str | None, bool]] = []
        segs = list(prefix)
        if self.peek() == "::":
            self.i += 1
        while self.i < len(self.t):
            tok = self.peek()
            if tok == "{":
                self.i += 1
                while self.peek() not in ("}", ""):
                    out += self.use_tree(segs)
                    if self.peek() == ",":
                        self.i += 1
                self.i += 1
                break
            if tok == "*":
                self.i += 1
                out.append((segs, None, True))
                break
            if tok in (";", ",", "}"):
                break
            self.i += 1
            if tok == "self" and segs:
                alias = segs[-1]
                if self.peek() == "as":
                    alias = self.peek(1)
                    self.i += 2
                out.append((segs, alias, False))
                break
            segs = segs + [tok]
            if self.peek() == "::":
                self.i += 1
                continue
            alias = tok
            if self.peek() == "as":
                alias = self.peek(1)
                self.i += 2
            if alias == "_":
                alias = None
            out.append((segs, alias, False))
            break
        if not prefix and self.peek() == ";":
            self.i += 1
        return out


# ---------------------------------------------------------------------------
# Checks.


def unit_of(rel: str) -> tuple[str, int] | None:
    best = None
    for prefix, unit, rank in LAYERS:
        # `a/` covers the module `a` in either form: `a.rs` or `a/mod.rs`
        # (and its children).
        if (
            rel == prefix
            or (prefix.endswith("/") and rel.startswith(prefix))
            or (prefix.endswith("/") and rel == prefix[:-1] + ".rs")
        ):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, unit, rank)
    return None if best is None else (best[1], best[2])


def sccs(nodes: list[str], adj: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, pi = work.pop()
            if pi == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on.add(v)
            recurse = False
            succ = adj.get(v, [])
            for k in range(pi, len(succ)):
                w = succ[k]
                if w not in index:
                    work.append((v, k + 1))
                    work.append((w, 0))
                    recurse = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
    return out


@dataclass
class Allowance:
    edges: set[tuple[str, str]] = field(default_factory=set)
    circles: set[frozenset[str]] = field(default_factory=set)


def read_allow(path: Path) -> tuple[Allowance, list[str]]:
    """`A -> B` (an arrow) or `circle: A, B, …` (exactly the files of one
    circle) per line; `#` starts a comment."""
    allow = Allowance()
    errors: list[str] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("circle:"):
            files = frozenset(f.strip() for f in line[len("circle:") :].split(",") if f.strip())
            named = sorted(files)
            if len(files) < 2:
                errors.append(f"{path}:{n}: a circle names two files or more: {line}")
                continue
        else:
            a, sep, b = line.partition("->")
            a, b = a.strip(), b.strip().split(" (")[0].strip()
            if not sep or not a or not b:
                errors.append(f"{path}:{n}: neither `A -> B` nor `circle: A, B`: {line}")
                continue
            named = [a, b]
        if any(f.startswith("crates/core/") for f in named):
            errors.append(f"{path}:{n}: crates/core/src takes no allowance: {line}")
            continue
        if line.startswith("circle:"):
            allow.circles.add(files)
        else:
            allow.edges.add((a, b))
    return allow, errors


def check(root: Path, allow: Path | None, graph: bool, out=sys.stdout) -> int:
    tree = Tree(root)
    if not tree.crates:
        print(f"no crate found under {root}", file=out)
        return 2
    edges = tree.edges()
    allowed = Allowance()
    if allow is not None:
        allowed, errors = read_allow(allow)
        if errors:
            for e in errors:
                print(e, file=out)
            return 2
    for e in tree.errors:
        print(f"warning: {e}", file=out)
    if graph:
        for (a, b), items in sorted(edges.items()):
            print(f"{a} -> {b} ({', '.join(sorted(items))})", file=out)

    def fmt(a: str, b: str) -> str:
        return f"{a} -> {b} ({', '.join(sorted(edges[(a, b)]))})"

    violations: list[str] = []
    pending: list[str] = []
    stale: list[str] = []

    # (a) circles of files.
    nodes = sorted({x for e in edges for x in e})
    adj: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        adj.setdefault(a, []).append(b)
    circles = [c for c in sccs(nodes, adj) if len(c) > 1]
    for comp in sorted(circles):
        inside = set(comp)
        lines = [fmt(a, b) for (a, b) in sorted(edges) if a in inside and b in inside]
        text = "circle of files: " + ", ".join(comp) + "\n    " + "\n    ".join(lines)
        (pending if frozenset(comp) in allowed.circles else violations).append(text)
    found = {frozenset(c) for c in circles}
    for c in sorted(allowed.circles - found, key=sorted):
        stale.append("circle: " + ", ".join(sorted(c)))

    # (b) arrows back up.
    arrows: set[tuple[str, str]] = set()
    for a, b in sorted(edges):
        ua, ub = unit_of(a), unit_of(b)
        if ua is None or ub is None:
            missing = a if ua is None else b
            violations.append(f"not in the layer table: {missing}: {fmt(a, b)}")
            continue
        if ua[0] == ub[0]:
            continue
        if ub[1] > ua[1]:
            text = f"arrow back up ({ua[0]} < {ub[0]}): {fmt(a, b)}"
        elif ub[1] == ua[1] and (ua[0], ub[0]) not in SIBLINGS_ALLOWED:
            text = f"arrow between siblings ({ua[0]}, {ub[0]}): {fmt(a, b)}"
        else:
            continue
        arrows.add((a, b))
        (pending if (a, b) in allowed.edges else violations).append(text)
    for a, b in sorted(allowed.edges - arrows):
        stale.append(f"{a} -> {b}")

    files = len(tree.files)
    print(f"{files} files, {len(edges)} file-level edges", file=out)
    for p in pending:
        print(f"pending (allowed: being fixed elsewhere): {p}", file=out)
    for s in stale:
        print(f"allowance no longer needed, remove it: {s}", file=out)
    for v in violations:
        print(v, file=out)
    if violations or stale:
        print(f"{len(violations)} violation(s), {len(stale)} stale allowance(s)", file=out)
        return 1
    if pending:
        print(f"no violation but the {len(pending)} pending above", file=out)
    else:
        print("no circle, no arrow back up", file=out)
    return 0


# ---------------------------------------------------------------------------
# Self-test: a tiny synthetic tree with a circle, an arrow back up, a facade
# and a test module; the checker must report exactly the first two.

SYNTHETIC = {
    "crates/core/src/lib.rs": """
        pub mod codec;
        pub mod dtype;
        pub mod error;
        pub use error::Error;
    """,
    "crates/core/src/error.rs": """
        /// An error; `crate::codec::encode` in a doc comment is no import.
        pub struct Error;
        const S: &str = "crate::dtype::width";
    """,
    # An arrow back up: dtype (rank 1) names an item of the codec.
    "crates/core/src/dtype.rs": """
        use crate::error::Error;
        pub fn width() -> usize { crate::codec::scan::PIECE }
    """,
    # A facade: re-exports are not edges.
    "crates/core/src/codec/mod.rs": """
        mod apply;
        pub mod scan;
        pub use apply::apply;
        pub use scan::PIECE;
    """,
    "crates/core/src/codec/scan.rs": """
        pub const PIECE: usize = 4096;
        pub(crate) fn helper() {}
        #[cfg(test)]
        mod tests {
            use crate::codec::apply::apply;
        }
    """,
    # A circle: apply.rs and parse.rs (in the parent's scope, `super::`)
    # use each other.
    "crates/core/src/codec/apply.rs": """
        mod parse;
        use self::parse::Job;
        pub fn apply() -> Job { super::scan::helper(); Job }
        pub(crate) struct Undo;
    """,
    "crates/core/src/codec/apply/parse.rs": """
        use super::Undo;
        pub(crate) struct Job;
    """,
    "src/lib.rs": """
        pub use weightcast_core::{codec, dtype, error};
        pub mod store;
    """,
    "src/store.rs": """
        use crate::codec::apply;
        pub fn put() { apply(); weightcast_core::dtype::width(); }
    """,
}


def self_test() -> int:
    import io
    import textwrap

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for rel, text in SYNTHETIC.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(textwrap.dedent(text), encoding="utf-8")
        # The layer table knows no `codec/apply/parse.rs`: it is in
        # `codec/apply/`, which the table covers.
        buf = io.StringIO()
        rc = check(root, None, graph=True, out=buf)
        text = buf.getvalue()
        expect = [
            "crates/core/src/codec/apply.rs -> crates/core/src/codec/apply/parse.rs (Job)",
            "crates/core/src/codec/apply/parse.rs -> crates/core/src/codec/apply.rs (Undo)",
            "circle of files: crates/core/src/codec/apply.rs, crates/core/src/codec/apply/parse.rs",
            "arrow back up (core:dtype < core:codec/scan): "
            "crates/core/src/dtype.rs -> crates/core/src/codec/scan.rs (crate::codec::scan::PIECE)",
            "src/store.rs -> crates/core/src/codec/apply.rs (apply)",
            "src/store.rs -> crates/core/src/dtype.rs (weightcast_core::dtype::width)",
            "crates/core/src/codec/apply.rs -> crates/core/src/codec/scan.rs (super::scan::helper)",
            "2 violation(s)",
        ]
        refuse = [
            "crates/core/src/codec/mod.rs ->",  # a facade's re-exports
            "crates/core/src/error.rs ->",  # comments and strings
            "crates/core/src/codec/scan.rs ->",  # test code
            "src/lib.rs ->",  # re-exported modules
        ]
        bad = [e for e in expect if e not in text] + [r for r in refuse if r in text]
        if rc != 1:
            bad.append(f"exit status {rc}, expected 1")
        # An allowance in core is refused; one for src/ is honoured.
        allow = root / "allow.txt"
        allow.write_text("crates/core/src/dtype.rs -> crates/core/src/codec/scan.rs\n")
        buf2 = io.StringIO()
        if check(root, allow, graph=False, out=buf2) != 2:
            bad.append("an allowance into crates/core/src was accepted")
        allow.write_text("circle: src/store.rs, src/nothing.rs  # stale\n")
        buf3 = io.StringIO()
        check(root, allow, graph=False, out=buf3)
        if "allowance no longer needed" not in buf3.getvalue():
            bad.append("a stale allowance was not reported")
        if bad:
            print(text)
            print("self-test FAILED:")
            for b in bad:
                print(f"  missing or wrong: {b}")
            return 1
    print("self-test passed: a circle and an arrow back up are reported; facades, tests, "
          "comments and strings are not edges; core takes no allowance")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--allow", type=Path, help="known violations, `A -> B` per line")
    ap.add_argument("--graph", action="store_true", help="print every file-level edge")
    ap.add_argument("--self-test", action="store_true", help="check the checker")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    return check(args.root, args.allow, args.graph)


if __name__ == "__main__":
    sys.exit(main())
