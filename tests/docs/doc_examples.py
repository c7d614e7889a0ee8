#!/usr/bin/env python3
"""The examples of README.md and docs/*.md, run, so that none can go stale.

  doc_examples.py cpp SOURCE_DIR OUT.cpp     every ```cpp block as a function of one program (the build
                                             compiles it: a stale example fails the build); its main()
                                             runs each block, in file order, from SOURCE_DIR
  doc_examples.py shell SOURCE_DIR KILN      every `kiln ...` command line of a fenced block, run with
                                             the built binary from SOURCE_DIR; a few kinds are skipped,
                                             each for a reason printed beside it (SKIPS below)
  doc_examples.py headers SOURCE_DIR         kiln/kiln.h includes every public header (README says so)
  doc_examples.py python SOURCE_DIR          every ```python block, each run on its own from SOURCE_DIR
                                             with this interpreter (the build's kiln package on its
                                             PYTHONPATH); `<!-- doc-test: skip (why) -->` before a block
                                             skips it (MAX's own code, shown beside kiln's)

A C++ block is written as if after `using namespace kiln; namespace ops = kiln::graph::ops;` (its
#include lines are gathered at the top of the program). An HTML comment right before a block, which a
reader of the rendered page does not see, can give it what it leaves out:

  <!-- doc-test: setup
  Tensor x = Tensor::zeros(DType::f32, {3, 4});      (C++ run before the block, in its scope)
  -->
  <!-- doc-test: compile-only (needs a GGUF file); params: const std::filesystem::path& dir -->

`compile-only (why)` compiles the block without running it; `params:` makes the block the body of a
function taking those parameters (the names it uses but cannot make), which implies compile-only.
"""
import pathlib
import re
import shlex
import subprocess
import sys

FENCE = re.compile(r"^```(\S*)\s*$")
DIRECTIVE = re.compile(r"<!--\s*doc-test:(.*?)-->", re.S)


def doc_files(source):
    source = pathlib.Path(source)
    return [source / "README.md"] + sorted((source / "docs").glob("*.md"))


def blocks(path):
    """(language, first line number, lines, directive text or None) for each fenced block."""
    lines = path.read_text(encoding="utf-8").split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        language, start = m.group(1), i + 1
        j = start
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        # A directive ends on the line before the fence (blank lines between are allowed).
        before = "\n".join(lines[max(0, i - 40):i]).rstrip()
        directive = None
        if before.endswith("-->"):
            found = list(DIRECTIVE.finditer(before))
            if found and found[-1].end() == len(before):
                directive = found[-1].group(1)
        out.append((language, start + 1, lines[start:j], directive))
        i = j + 1
    return out


# ---- C++ -----------------------------------------------------------------------------------------

def parse_directive(text):
    setup, compile_only, params = [], None, None
    if text is None:
        return setup, compile_only, params
    head, _, rest = text.partition("\n")
    head = head.strip()
    if head == "setup":
        setup = rest.rstrip().split("\n")
        return setup, compile_only, params
    for part in re.split(r";\s*(?=params:|compile-only)", head):
        part = part.strip()
        if part.startswith("compile-only"):
            compile_only = part[len("compile-only"):].strip() or "(no reason given)"
        elif part.startswith("params:"):
            params = part[len("params:"):].strip()
            compile_only = compile_only or "(it takes parameters)"
        elif part:
            raise SystemExit(f"doc-test directive not understood: {part!r}")
    return setup, compile_only, params


def cpp(source, out_path):
    source = pathlib.Path(source)
    includes = {"#include <kiln/kiln.h>", "#include <cstdio>", "#include <exception>", "#include <iostream>"}
    functions, runs = [], []
    for path in doc_files(source):
        for n, (language, line, body, directive) in enumerate(blocks(path)):
            if language != "cpp":
                continue
            setup, compile_only, params = parse_directive(directive)
            name = f"{path.stem.replace('-', '_')}_{line}"
            where = f"{path.relative_to(source)}:{line}"
            code = []
            for text in setup + body:
                if text.strip().startswith("#include"):
                    includes.add(text.strip())
                else:
                    code.append(text)
            functions.append(
                f"// {where}{' (compile-only ' + compile_only + ')' if compile_only else ''}\n"
                f"namespace {name} {{\nusing namespace kiln;\nnamespace ops = kiln::graph::ops;\n"
                f"[[maybe_unused]] void example({params or ''}) {{\n#line {line} \"{where}\"\n"
                + "\n".join(code) + "\n}\n}  // namespace " + name + "\n")
            if not compile_only:
                runs.append((where, name))
    program = ["// Generated by tests/docs/doc_examples.py from README.md and docs/*.md: do not edit.",
               *sorted(includes), "", *functions, "int main() {", "  int failed = 0;"]
    for where, name in runs:
        program += [f'  std::fprintf(stderr, "doc example {where}\\n");',
                    f"  try {{ {name}::example(); }} catch (const std::exception& e) {{",
                    f'    std::fprintf(stderr, "doc example {where} threw: %s\\n", e.what());',
                    "    ++failed;", "  }"]
    program += [f'  std::fprintf(stderr, "%d of {len(runs)} doc examples failed\\n", failed);',
                "  return failed == 0 ? 0 : 1;", "}", ""]
    text = "\n".join(program)
    out_path = pathlib.Path(out_path)
    if not out_path.exists() or out_path.read_text() != text:  # unchanged: nothing to recompile
        out_path.write_text(text)


# ---- shell commands ------------------------------------------------------------------------------

KILN = re.compile(r"^(\./build/kiln|build/kiln|kiln)(\s|$)")
# Uppercase words that stand for a value the reader fills in.
PLACEHOLDER = re.compile(r"(^|[\s=])(DIR|TEXT|FILE|NAME|KEY|N|T|L|G|P|S|SEED|SECONDS|\.\.\.)(\s|$|[,\]])")
SKIPS = [  # (what a command contains, why it is not run)
    (re.compile(r"\[|\||\.\.\."), "a synopsis of the options, not a command"),
    (PLACEHOLDER, "a synopsis: it has a placeholder for the reader's value"),
    (re.compile(r"^kiln serve"), "serves until a signal: tests/serve/clients start `kiln serve` for real"),
    (re.compile(r"^kiln bench"), "measures for minutes: tests/tools/test_bench.cpp runs each kind on small sizes"),
    (re.compile(r"\.gguf|~/|llama-1B|stories110M"), "needs a model file or a model size the repository does not hold"),
]


def commands(source):
    """(where, command line) for each kiln command of a fenced block, continuation lines joined."""
    for path in doc_files(source):
        for language, line, body, _ in blocks(path):
            if language not in ("", "sh", "bash", "console"):
                continue
            i = 0
            while i < len(body):
                text, first = body[i], i
                while text.endswith("\\") and i + 1 < len(body):
                    i += 1
                    text = text[:-1] + " " + body[i].strip()
                i += 1
                for segment in text.split("&&"):
                    segment = segment.strip()
                    if KILN.match(segment):
                        yield f"{path.relative_to(pathlib.Path(source))}:{line + first}", segment


def shell(source, kiln_binary):
    ran, failed = 0, []
    for where, command in commands(source):
        normalized = KILN.sub("kiln ", command, count=1).strip()
        without_comment = re.sub(r"\s+#.*$", "", normalized)
        reason = next((why for pattern, why in SKIPS if pattern.search(without_comment)), None)
        if reason:
            print(f"skipped {where}: {command}\n  ({reason})")
            continue
        line = shlex.quote(kiln_binary) + without_comment[len("kiln"):]
        print(f"running {where}: {command}", flush=True)
        try:
            result = subprocess.run(["bash", "-c", line], cwd=source, input="Hello\n", capture_output=True,
                                    text=True, timeout=300)
            ran += 1
            if result.returncode != 0:
                failed.append(f"{where}: `{command}` exited {result.returncode}:\n{result.stderr[-2000:]}")
        except subprocess.TimeoutExpired:
            failed.append(f"{where}: `{command}` ran past 300 s")
    print(f"{ran} commands run, {len(failed)} failed")
    for f in failed:
        print("FAILED " + f, file=sys.stderr)
    return 1 if failed or ran == 0 else 0


# ---- kiln/kiln.h ---------------------------------------------------------------------------------

# ---- Python --------------------------------------------------------------------------------------

def python(source):
    source = pathlib.Path(source)
    failed = ran = 0
    for path in doc_files(source):
        for language, line, body, directive in blocks(path):
            if language != "python":
                continue
            where = f"{path.relative_to(source)}:{line}"
            if directive and directive.strip().startswith("skip"):
                print(f"skipped {where}: {directive.strip()[len('skip'):].strip() or '(no reason given)'}")
                continue
            ran += 1
            # Its own process: each block is a program a reader could paste, imports included.
            result = subprocess.run([sys.executable, "-c", "\n".join(body)], cwd=source, capture_output=True,
                                    text=True, timeout=300)
            if result.returncode != 0:
                failed += 1
                print(f"doc example {where} failed:\n{result.stdout}{result.stderr}")
            else:
                print(f"ran {where}")
    print(f"{failed} of {ran} Python doc examples failed")
    return 1 if failed or not ran else 0


def headers(source):
    include = pathlib.Path(source) / "include"
    umbrella = (include / "kiln" / "kiln.h").read_text()
    included = set(re.findall(r'#include "(kiln/[^"]+)"', umbrella))
    public = {str(p.relative_to(include)) for p in include.rglob("*.h")} - {"kiln/kiln.h", "kiln/extension.h"}
    public.add("kiln/version.h")  # generated into the build tree
    missing = sorted(public - included)
    for h in missing:
        print(f"kiln/kiln.h does not include {h}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "cpp" and len(sys.argv) == 4:
        cpp(sys.argv[2], sys.argv[3])
    elif mode == "shell" and len(sys.argv) == 4:
        sys.exit(shell(sys.argv[2], sys.argv[3]))
    elif mode == "headers" and len(sys.argv) == 3:
        sys.exit(headers(sys.argv[2]))
    elif mode == "python" and len(sys.argv) == 3:
        sys.exit(python(sys.argv[2]))
    else:
        sys.exit(__doc__)
