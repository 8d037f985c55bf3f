"""Streaming chat against a running disagg node (decode, colocated or router) with the `openai` package.

    disagg up                                  # or any `disagg serve` decode/colocated node
    python examples/openai_client.py "Write a haiku about the sea."
    python examples/openai_client.py --base-url http://10.0.0.5:8000/v1 --api-key "$DISAGG_API_KEY" "Hi!"
"""

import argparse
import os
import sys
import time

import openai


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("message", nargs="?", default="In one sentence, what is disaggregated prefill?",
                        help="the user message")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the node's OpenAI API")
    # The openai client insists on some key; a node started without --api-key accepts any.
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                        help="the node's --api-key (default: $OPENAI_API_KEY)")
    parser.add_argument("--model", default=None, help="model name (default: the first one the node serves)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=120.0, max_retries=0)
    try:
        model = args.model or client.models.list().data[0].id
        start = time.perf_counter()
        first_token_at = None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.message}],
            max_tokens=args.max_tokens, temperature=args.temperature, stream=True)
        print(f"> {args.message}")
        for chunk in stream:
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                first_token_at = first_token_at or time.perf_counter()
                print(text, end="", flush=True)
    except openai.APIConnectionError as e:
        print(f"cannot reach {args.base_url} ({e.__cause__ or e}): is a node running there? "
              "Start one with `disagg up` or pass --base-url", file=sys.stderr)
        return 1
    except openai.APIStatusError as e:
        print(f"{args.base_url} answered {e.status_code}: {e.message}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    ttft = f"first token after {first_token_at - start:.2f}s, " if first_token_at else "no text, "
    print(f"\n\n({model}: {ttft}all in {elapsed:.2f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
