#!/usr/bin/env python3
"""Checks the links of every Markdown file of the repository.

  tests/docs/check_links.py [--root DIR]

Walks every *.md file under the repository root (skipping .git, hidden
folders and build* folders), finds every inline link or image target
`[text](target)` and every reference definition `[label]: target`, and
checks each relative one:

  - http(s):, mailto: and other URL schemes are not checked;
  - the path (before '#') is resolved against the file's folder, or
    against the repository root when it starts with '/', and must exist;
  - an anchor ('#x' alone, or 'FILE.md#x') must be the slug of a heading
    of that Markdown file (GitHub's rules: lowercase, punctuation other
    than '-' and '_' dropped, each space a '-', '-1', '-2' ... for
    repeats); anchors into other kinds of files are not checked.

Code spans and fenced code blocks are skipped. Also checks that README.md
at the root links every other Markdown file (its map of the documents).
Exit status 0 when every link resolves, 1 otherwise, listing
file:line: target and the reason.
"""
import argparse
import os
import re
import sys

SKIP_DIRS = {".git"}
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
FENCE = re.compile(r"^ {0,3}(```+|~~~+)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in SKIP_DIRS and not d.startswith(".")
            and not d.startswith("build"))
        for name in sorted(filenames):
            if name.endswith(".md"):
                yield os.path.join(dirpath, name)


def strip_code_spans(line):
    # `code` spans hold examples, not links.
    return re.sub(r"(`+)(.+?)\1", "", line)


def lines_outside_fences(text):
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            marker = m.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading):
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # link text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


_anchor_cache = {}


def anchors(path):
    if path not in _anchor_cache:
        seen = {}
        result = set()
        with open(path, encoding="utf-8") as f:
            for _, line in lines_outside_fences(f.read()):
                m = HEADING.match(line)
                if not m:
                    continue
                s = slug(m.group(2))
                n = seen.get(s, 0)
                seen[s] = n + 1
                result.add(s if n == 0 else "%s-%d" % (s, n))
        _anchor_cache[path] = result
    return _anchor_cache[path]


def targets(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for number, line in lines_outside_fences(text):
        if line.startswith("    ") or line.startswith("\t"):
            continue  # an indented code block
        line = strip_code_spans(line)
        m = REFDEF.match(line)
        if m:
            yield number, m.group(1)
            continue
        for m in INLINE.finditer(line):
            yield number, m.group(1)


def check(root):
    errors = []
    linked_from_readme = set()
    readme = os.path.join(root, "README.md")
    files = list(markdown_files(root))
    for path in files:
        rel = os.path.relpath(path, root)
        for number, target in targets(path):
            target = target.strip("<>")
            if SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            if file_part == "":
                dest = path
            elif file_part.startswith("/"):
                dest = os.path.join(root, file_part.lstrip("/"))
            else:
                dest = os.path.join(os.path.dirname(path), file_part)
            dest = os.path.normpath(dest)
            where = "%s:%d: %s" % (rel, number, target)
            if not os.path.exists(dest):
                errors.append("%s: no such file %s" % (where, os.path.relpath(dest, root)))
                continue
            if path == readme and dest.endswith(".md"):
                linked_from_readme.add(dest)
            if anchor and dest.endswith(".md") and os.path.isfile(dest):
                if anchor not in anchors(dest):
                    errors.append("%s: no heading #%s in %s" % (where, anchor, os.path.relpath(dest, root)))
    if os.path.exists(readme):
        for path in files:
            if path != readme and os.path.normpath(path) not in linked_from_readme:
                errors.append("README.md: the map of the documents lacks %s" % os.path.relpath(path, root))
    return files, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    parser.add_argument("--root", default=default_root, help="repository root (default: this script's ../..)")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    files, errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print("check_links: %d broken link(s) in %d Markdown files" % (len(errors), len(files)))
        return 1
    print("check_links: every relative link of %d Markdown files resolves" % len(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
