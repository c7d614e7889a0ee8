#!/usr/bin/env python3
"""Reference renderer for kiln's chat-template tests: python3-jinja2 configured exactly as
transformers' apply_chat_template configures it (transformers/utils/chat_template_utils.py).

Usage: render_chat_template.py TEMPLATE_FILE CONTEXTS_JSON_FILE
Prints a JSON list with one entry per context: {"text": render} or {"error": message}.
"""
import json
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class AssistantTracker(jinja2.ext.Extension):
    # transformers' {% generation %} ... {% endgeneration %}: marks the assistant's tokens; the text
    # renders unchanged.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        source = f.read()
    with open(sys.argv[2], encoding="utf-8") as f:
        contexts = json.load(f)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)
    results = []
    for context in contexts:
        try:
            results.append({"text": template.render(**context)})
        except Exception as e:  # any failure is a result the C++ side compares
            results.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(results, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
