import torch

import kvcompress
from kvcompress.eval.data import gutenberg_books
from kvcompress.generation import cache_argument
from kvcompress.models import load_model

model, tokenizer = load_model("smollm2-135m")  # offline; or any Hugging Face id or local path
words = gutenberg_books()[2].text.split()[2000:2600]  # ~1,200 tokens of a book shipped with the package
words.insert(300, "One of the special magic numbers for lucky-meadow is: 4826193.")
prompt = (
    "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about "
    "the number afterwards.\n" + " ".join(words) + "\nWhat is the special magic number for lucky-meadow mentioned "
    "in the provided text?"
)
chat = [{"role": "user", "content": prompt}]
text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
text += "The special magic number for lucky-meadow mentioned in the provided text is"
ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

for method, params in (("full", {}), ("tova_oneshot", {"ratio": 0.3}), ("streaming", {"budget": 256})):
    cache = kvcompress.cache_for(model, method, **params)
    with torch.no_grad():  # cache_argument: cache= (transformers >= 5.24) or past_key_values= (older)
        out = model.generate(ids, **cache_argument(model, cache), max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    stored = f"{max(cache.tokens_stored())} of {cache.tokens_seen()} tokens stored"
    print(f"{method:12} {answer!r:12} {stored}, {cache.nbytes() / 2**20:.1f} MiB")
