#!/usr/bin/env python3
"""The router's import graph: one way down, no circle larger than two files.

Reads every production .rs file under router/src (test modules excluded: a
`#[cfg(test)]` module's file, and `#[cfg(test)]` items inside a file), builds
the file-level graph of what each file uses from the others, and fails
(exit 1) when

- files import each other in a circle of more than two files (printed with
  one concrete circle), or
- a file imports one in a layer above its own (LAYERS, top first), or a file
  is in no layer.

An edge is what a file names of another: `use crate::...` / `use super::...`
/ `use self::...` / `use <child module>::...` lines (brace groups and `as`
included), and paths written inline (`crate::metrics::render(..)`,
`tools::lark(..)` after `use crate::tools`). Declaring a module (`mod x;`)
is no edge. A name a `mod.rs` only re-exports (`pub use x::Y`) resolves to
the file that defines it, so a directory's mod.rs is not a hub that joins
every file importing through it.

Python 3 standard library only; `--root DIR` checks another tree (the
tests feed it small synthetic ones), `--no-layers` checks circles only.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Top first: a file may import files of its own layer and of the layers below.
# Data flows http -> validation -> routing -> the batching loop -> scheduler -> kv / shard client;
# the types they hand each other (request types, queue entries and events, shared counters) sit below
# everyone who passes them on.
LAYERS: list[tuple[str, list[str]]] = [
    ("entry", ["lib.rs", "python.rs", "config.rs", "groups.rs", "serve.rs"]),
    ("http", ["http/*"]),
    ("chat text", ["chat_template.rs", "tools/*", "reasoning.rs"]),
    ("metrics exposition", ["metrics/exposition.rs", "metrics/kv_tier.rs", "metrics/gateway_names.rs"]),
    ("front door", ["infer.rs"]),
    ("request stream", ["stream.rs", "detokenize.rs", "stop.rs"]),
    ("validation", ["validation.rs"]),
    ("lora adapters served", ["lora/*"]),
    ("batching loop", ["batching/*"]),
    ("kv events publisher", ["kv_events/*"]),
    ("routing", ["routing/*"]),
    ("scheduler", ["scheduler/*"]),
    ("queue", ["queue.rs"]),
    ("kv and shard client", ["kv/*", "client/*"]),
    (
        "foundation",
        [
            "request.rs",
            "adapter.rs",
            "response.rs",
            "error.rs",
            "proto.rs",
            "grammar.rs",
            "shared_state.rs",
            "metrics/mod.rs",
            "metrics/histogram.rs",
        ],
    ),
]

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


# ---------------------------------------------------------------- lexing


def strip(src: str) -> str:
    """The source with comments, string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(src)

    def blank(s: str) -> str:
        return "".join("\n" if c == "\n" else " " for c in s)

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(src[i:j]))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(src[i:j]))
            i = j
        elif (m := re.compile(r'b?r(#*)"').match(src, i)) and (i == 0 or not _word(src[i - 1])):
            close = '"' + m.group(1)
            j = src.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append(blank(src[i:j]))
            i = j
        elif c == '"' or (c == "b" and src.startswith('b"', i) and (i == 0 or not _word(src[i - 1]))):
            j = i + (2 if c == "b" else 1)
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(blank(src[i : j + 1]))
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}'), else a lifetime or label ('a).
            m = re.compile(r"'(\\(u\{[0-9a-fA-F]*\}|x[0-9a-fA-F]{2}|.)|[^\\'])'").match(src, i)
            if m:
                out.append(blank(m.group(0)))
                i = m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


def matching_brace(code: str, open_at: int) -> int:
    """Index just past the `}` closing the `{` at `open_at` (code already stripped)."""
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


ATTR = re.compile(r"#\s*\[")


def attribute_end(code: str, at: int) -> int:
    """Index just past the attribute `#[...]` starting at `at`."""
    depth = 0
    for j in range(code.index("[", at), len(code)):
        if code[j] == "[":
            depth += 1
        elif code[j] == "]":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


def item_end(code: str, at: int) -> int:
    """Index just past the item starting at `at`: its `;`, or its brace block."""
    depth = 0
    for j in range(at, len(code)):
        ch = code[j]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0 and ch == ";":
            return j + 1
        elif depth == 0 and ch == "{":
            return matching_brace(code, j)
    return len(code)


# ---------------------------------------------------------------- files and modules


@dataclass
class Use:
    path: list[str]  # segments, possibly ending in "*"
    alias: str | None  # the name it brings into scope (None for globs)
    public: bool  # `pub use`: a re-export
    scope: tuple[str, ...]  # the module the statement is in


@dataclass
class RsFile:
    rel: str
    code: str = ""  # stripped, test items blanked
    module: tuple[str, ...] = ()
    uses: list[Use] = field(default_factory=list)
    body: str = ""  # code without its use statements
    inline: list[tuple[int, int, tuple[str, ...]]] = field(default_factory=list)  # inline `mod x { }` spans


class Crate:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, RsFile] = {}
        self.modules: dict[tuple[str, ...], str] = {}  # module path -> file (rel)
        self.test_files: set[str] = set()
        self.problems: list[str] = []
        self._load(root / "lib.rs", ())

    def _load(self, path: Path, module: tuple[str, ...]) -> None:
        rel = path.relative_to(self.root).as_posix()
        f = RsFile(rel=rel, module=module)
        self.files[rel] = f
        self.modules[module] = rel
        code = strip(path.read_text(encoding="utf-8"))
        code = self._blank_tests(code, path, module)
        f.code = code
        self._inline_modules(f)
        for name, sub_path in self._declared_modules(code, path):
            if sub_path is None:
                continue
            if not sub_path.exists():
                self.problems.append(f"{rel}: module `{name}` has no file ({sub_path.relative_to(self.root)})")
                continue
            self._load(sub_path, module + (name,))
        self._parse_uses(f)

    def _child_dir(self, path: Path) -> Path:
        return path.parent if path.name in ("lib.rs", "mod.rs", "main.rs") else path.parent / path.stem

    def _module_file(self, path: Path, name: str, explicit: str | None) -> Path:
        if explicit is not None:
            return path.parent / explicit
        d = self._child_dir(path)
        flat = d / f"{name}.rs"
        return flat if flat.exists() else d / name / "mod.rs"

    def _blank_tests(self, code: str, path: Path, module: tuple[str, ...]) -> str:
        """Blanks `#[cfg(test)]` items; the files of `#[cfg(test)] mod x;` become test files."""
        for m in reversed(list(re.finditer(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", code))):
            j = m.end()
            explicit = None
            while True:
                k = len(code[j:]) - len(code[j:].lstrip())
                if ATTR.match(code, j + k):
                    end = attribute_end(code, j + k)
                    if re.search(r"\bpath\s*=", code[j + k : end]):  # its literal was blanked: read the original
                        raw = path.read_text(encoding="utf-8")[j + k : end]
                        explicit = re.search(r'path\s*=\s*"([^"]*)"', raw).group(1)
                    j = end
                    continue
                j += k
                break
            end = item_end(code, j)
            dm = re.match(rf"(?:pub(?:\([^)]*\))?\s+)?mod\s+({IDENT})\s*;", code[j:end])
            if dm:
                sub = self._module_file(path, dm.group(1), explicit)
                self.test_files.add(sub.relative_to(self.root).as_posix() if sub.exists() else str(sub))
            code = code[: m.start()] + "".join("\n" if c == "\n" else " " for c in code[m.start() : end]) + code[end:]
        return code

    def _declared_modules(self, code: str, path: Path):
        raw = path.read_text(encoding="utf-8")
        for m in re.finditer(rf"(?<![\w:])(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+({IDENT})\s*;", code):
            # An explicit `#[path = "..."]` right before it.
            before = raw[max(0, m.start() - 200) : m.start()]
            pm = re.search(r'#\s*\[\s*path\s*=\s*"([^"]*)"\s*\]\s*$', before)
            yield m.group(1), self._module_file(path, m.group(1), pm.group(1) if pm else None)

    def _inline_modules(self, f: RsFile) -> None:
        for m in re.finditer(rf"(?<![\w:])(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+({IDENT})\s*\{{", f.code):
            open_at = m.end() - 1
            f.inline.append((open_at, matching_brace(f.code, open_at), (m.group(1),)))
        # Nested inline modules get their full path; each maps to this file.
        resolved = []
        for start, end, (name,) in f.inline:
            outer = [n for s, e, (n,) in f.inline if s < start and end <= e]
            resolved.append((start, end, f.module + tuple(outer) + (name,)))
        f.inline = resolved
        for _, _, mod in f.inline:
            self.modules[mod] = f.rel

    def scope_at(self, f: RsFile, pos: int) -> tuple[str, ...]:
        best = f.module
        for s, e, mod in f.inline:
            if s < pos < e and len(mod) > len(best):
                best = mod
        return best

    def _parse_uses(self, f: RsFile) -> None:
        code = f.code
        body = list(code)
        pattern = rf"(?<![\w:])(pub(?:\s*\([^)]*\))?\s+)?use\s+"
        for m in re.finditer(rf"(?<![\w:])(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+{IDENT}\s*;", code):
            body[m.start() : m.end()] = " " * (m.end() - m.start())  # a declaration names no item
        for m in re.finditer(pattern, code):
            end = code.find(";", m.end())
            end = len(code) if end < 0 else end
            tree = code[m.end() : end]
            scope = self.scope_at(f, m.start())
            for path, alias in expand_use(tree):
                f.uses.append(Use(path, alias, bool(m.group(1)), scope))
            for k in range(m.start(), min(end + 1, len(body))):
                if body[k] != "\n":
                    body[k] = " "
        f.body = "".join(body)


def expand_use(tree: str) -> list[tuple[list[str], str | None]]:
    """`a::{b, c::{self as d, e}}` -> [(path, alias)...]; globs end in "*" with no alias."""
    toks = re.findall(rf"::|{IDENT}|[{{}},*]", tree)
    out: list[tuple[list[str], str | None]] = []
    pos = 0

    def parse(prefix: list[str]) -> None:
        nonlocal pos
        path = list(prefix)
        while pos < len(toks):
            t = toks[pos]
            if t == "::":
                pos += 1
            elif t == "{":
                pos += 1
                while pos < len(toks) and toks[pos] != "}":
                    parse(path)
                    if pos < len(toks) and toks[pos] == ",":
                        pos += 1
                pos += 1
                return
            elif t == "*":
                pos += 1
                out.append((path + ["*"], None))
                return
            elif t in (",", "}"):
                break
            elif t == "as":
                alias = toks[pos + 1]
                pos += 2
                if path and path[-1] == "self":
                    path = path[:-1]
                out.append((path, None if alias == "_" else alias))
                return
            else:
                path.append(t)
                pos += 1
        if path and path != prefix:
            name = path[-1]
            if name == "self":
                path = path[:-1]
                name = path[-1] if path else None
            out.append((path, name))

    while pos < len(toks):
        parse([])
        if pos < len(toks) and toks[pos] == ",":
            pos += 1
        elif pos < len(toks):
            pos += 1
    return out


# ---------------------------------------------------------------- resolution


class Resolver:
    def __init__(self, crate: Crate) -> None:
        self.crate = crate

    def children(self, module: tuple[str, ...]) -> set[str]:
        return {m[len(module)] for m in self.crate.modules if len(m) == len(module) + 1 and m[: len(module)] == module}

    def aliases(self, f: RsFile, scope: tuple[str, ...]) -> dict[str, Use]:
        return {u.alias: u for u in f.uses if u.alias and u.scope == scope}

    def start(self, f: RsFile, scope: tuple[str, ...], first: str, seen: frozenset) -> tuple[str, ...] | None:
        """The module a path's first segment names, or None (an item, a foreign crate)."""
        if first == "crate":
            return ()
        if first == "self":
            return scope
        if first == "super":
            return scope[:-1]
        if first in self.children(scope):
            return scope + (first,)
        u = self.aliases(f, scope).get(first)
        if u is not None and (f.rel, tuple(u.path)) not in seen:
            target = self.resolve(f, u.scope, u.path, seen | {(f.rel, tuple(u.path))})
            if target and target[0] == "module":
                return target[1]
        return None

    def resolve(self, f: RsFile, scope: tuple[str, ...], path: list[str], seen=frozenset()):
        """("module", path) when the path names a module; ("file", rel) for an item; None outside the crate."""
        if not path:
            return None
        cur = self.start(f, scope, path[0], seen)
        if cur is None:
            # An imported item used as the head of a path (`Finish::Length`): the import's own edge counts.
            return None
        i = 1
        while i < len(path) and path[i] == "super":
            cur, i = cur[:-1], i + 1
        while i < len(path) and cur + (path[i],) in self.crate.modules:
            cur, i = cur + (path[i],), i + 1
        if cur not in self.crate.modules:
            return None
        if i == len(path) or path[i] == "*":
            return ("module", cur)
        return ("file", self.through_reexports(cur, path[i], seen))

    def through_reexports(self, module: tuple[str, ...], name: str, seen) -> str:
        """The file that defines `name` of `module`, following `pub use` re-exports."""
        rel = self.crate.modules[module]
        f = self.crate.files[rel]
        for u in f.uses:
            if u.public and u.scope == module and u.alias == name and (rel, name) not in seen:
                target = self.resolve(f, module, u.path, seen | {(rel, name)})
                if target is None:
                    return rel
                return target[1] if target[0] == "file" else self.crate.modules[target[1]]
        return rel


INLINE_PATH = re.compile(rf"(?<![\w:])((?:{IDENT}\s*::\s*)+{IDENT})")


def graph(crate: Crate) -> dict[str, set[str]]:
    r = Resolver(crate)
    edges: dict[str, set[str]] = {rel: set() for rel in crate.files if rel not in crate.test_files}

    def add(f: RsFile, target) -> None:
        if target is None:
            return
        rel = target[1] if target[0] == "file" else None
        if rel and rel != f.rel and rel in edges:
            edges[f.rel].add(rel)

    for f in crate.files.values():
        if f.rel in crate.test_files:
            continue
        for u in f.uses:
            if u.path and u.path[-1] == "*":
                target = r.resolve(f, u.scope, u.path[:-1])
                if target and target[0] == "module":
                    add(f, ("file", crate.modules[target[1]]))
                continue
            target = r.resolve(f, u.scope, u.path)
            if target is None or target[0] == "module":
                continue  # a module brought into scope: its uses below make the edges
            if u.public and not re.search(rf"(?<![\w:]){re.escape(u.alias or '')}(?!\w)", f.body):
                continue  # only passed on: the importer's edge goes to the defining file
            add(f, target)
        for m in INLINE_PATH.finditer(f.body):
            segs = re.split(r"\s*::\s*", m.group(1))
            add(f, r.resolve(f, crate.scope_at(f, m.start()), segs))
    return edges


# ---------------------------------------------------------------- checks


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    for root in sorted(edges):
        if root in index:
            continue
        # Iterative Tarjan: (node, iterator over its successors).
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def a_circle(edges: dict[str, set[str]], members: list[str], budget: int = 200_000) -> list[str]:
    """A circle of more than two files inside a component (depth-first, bounded), else its members."""
    inside = set(members)
    for start in members:
        path, stack = [start], [iter(sorted(edges[start] & inside))]
        on_path = {start}
        while stack and budget > 0:
            budget -= 1
            w = next(stack[-1], None)
            if w is None:
                stack.pop()
                on_path.discard(path.pop())
            elif w == start and len(path) > 2:
                return path + [start]
            elif w not in on_path and w > start:  # each circle once: from its smallest member
                path.append(w)
                on_path.add(w)
                stack.append(iter(sorted(edges[w] & inside)))
    return members


def layer_of(rel: str, layers) -> int | None:
    for i, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(rel, p) for p in patterns):
            return i
    return None


def check(root: Path, layers) -> tuple[list[str], str]:
    crate = Crate(root)
    edges = graph(crate)
    errors = list(crate.problems)
    comps = strongly_connected(edges)
    big = [c for c in comps if len(c) > 2]
    pairs = [c for c in comps if len(c) == 2]
    for c in big:
        circle = a_circle(edges, c)
        errors.append(f"circle of {len(c)} files: {' -> '.join(circle)}  (all of: {', '.join(c)})")
    upward = 0
    if layers:
        for rel in sorted(edges):
            if layer_of(rel, layers) is None:
                errors.append(f"{rel} is in no layer: add it to LAYERS in {Path(__file__).name}")
        for rel in sorted(edges):
            mine = layer_of(rel, layers)
            for dep in sorted(edges[rel]):
                theirs = layer_of(dep, layers)
                if mine is not None and theirs is not None and theirs < mine:
                    upward += 1
                    errors.append(
                        f"{rel} ({layers[mine][0]}) imports {dep} ({layers[theirs][0]}), a layer above it"
                    )
    n_edges = sum(len(v) for v in edges.values())
    largest = max((len(c) for c in comps), default=1)
    summary = (
        f"{root}: {len(edges)} files, {n_edges} imports, "
        f"{len(big)} circle(s) over two files, {len(pairs)} of two, largest {largest if largest > 1 else 0}"
        + (f", {upward} import(s) running up {len(layers)} layers" if layers else "")
    )
    return errors, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=REPO / "router" / "src", help="the crate's src directory")
    ap.add_argument("--no-layers", action="store_true", help="check circles only")
    ap.add_argument("--graph", action="store_true", help="print every file's imports")
    args = ap.parse_args(argv)
    if not (args.root / "lib.rs").exists():
        print(f"{args.root}: no lib.rs", file=sys.stderr)
        return 2
    errors, summary = check(args.root, None if args.no_layers else LAYERS)
    if args.graph:
        edges = graph(Crate(args.root))
        for rel in sorted(edges):
            print(f"{rel} -> {', '.join(sorted(edges[rel])) or '-'}")
    for e in errors:
        print(f"error: {e}")
    print(("FAILED: " if errors else "ok: ") + summary)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
