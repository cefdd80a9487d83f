"""Tasks the package generates, so that the default jobs and the tests run offline with a real metric.

- `addition` / `subtraction`: "37+45=" -> "082", "45-37=" -> "08". A model that has not learned the operation
  gets almost no whole answer right; a small Llama trained for a few epochs on a CPU gets nearly all. As
  conversations (the user's "37+45", the assistant's "082") they are the default sft task: LoRA teaches the
  chat form to the model that learned the plain form.
- `topics`: short generated sentences about one of four topics, for sequence classification.

Tokenizers are built or trained locally (a character vocabulary; a word vocabulary trained on the corpus), so
nothing is downloaded.
"""

from __future__ import annotations

import random

import numpy as np

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ALPHABET = list("0123456789+-*=()., :?!'\n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
# The chat template of the character tokenizer: the user's message on one line, the assistant's answer on the
# next, ended by </s>; system text on a line of its own. The default sft job teaches a model pre-trained on plain
# "37+45=082" lines to answer "37+45" on the next line: the answer stands where it stood after "=", so the
# adapter learns the new prompt, not the arithmetic, and what it learns holds for problems it never saw.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}\n{% endif %}{% endfor %}"
)
OPERATIONS = {"addition": "+", "subtraction": "-"}


def char_tokenizer():
    """A character-level PreTrainedTokenizerFast (special tokens first, then ALPHABET) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + ALPHABET)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join without spaces when decoded
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=UNK, model_max_length=512)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def arithmetic_pairs(task: str, digits: int = 2) -> list[tuple[str, str]]:
    """Every problem of `task` with operands below 10**digits (subtraction: never negative), with its answer."""
    # fixed width, zero-padded: every digit keeps its position, which small models learn far faster
    top, op, w = 10 ** digits, OPERATIONS[task], digits
    if op == "+":
        return [(f"{a:0{w}d}+{b:0{w}d}=", f"{a + b:0{w + 1}d}") for a in range(top) for b in range(top)]
    return [(f"{a:0{w}d}-{b:0{w}d}=", f"{a - b:0{w}d}") for a in range(top) for b in range(a + 1)]


def arithmetic_splits(task: str, num_train: int, num_eval: int, digits: int = 2, seed: int = 0):
    """Disjoint train / held-out problems, drawn without replacement (held-out problems are never trained on).

    Training problems come from the front of one shuffle (by seed), held-out ones from its end, so runs with the
    same seed and num_eval hold out the same problems whatever their num_train: the sft job's held-out problems
    are ones that the clm job that made its base never saw either."""
    pairs = arithmetic_pairs(task, digits)
    if num_train + num_eval > len(pairs):
        raise ValueError(f"num_train + num_eval = {num_train + num_eval}: only {len(pairs)} distinct "
                         f"{digits}-digit {task} problems exist")
    random.Random(seed).shuffle(pairs)
    return pairs[:num_train], pairs[len(pairs) - num_eval:]


# The `records` task: a sentence about a person -> the YAML record of their name, age and city, one "key: value"
# line each. SmolLM2-135M-Instruct (the main job's model) answers in prose or in a shape of its own, so it gets
# almost none exactly right; a LoRA adapter learns the shape in a few dozen steps. YAML rather than JSON: in
# the sentence every name follows a space, and so it does after "name: ", where the model copies the same tokens;
# after a JSON quote 107 of the 186 names split into other tokens (" Hugo" is one token, '"Hugo' is '"', 'H',
# 'ug', 'o'), and one held-out first name misspelled that way cost 4-6 points of held-out exact match. Held-out
# people have first names and surnames that no training sentence contains, so an adapter that only memorised its
# rows gets none of them right. No name is also a city, which would make a sentence ambiguous ("Sofia is home
# to ...").
FIRST_NAMES = """Ana Ben Clara Daniel Elena Felix Grace Hugo Iris Jonas Karin Leo Mara Nils Olga Pablo Rosa Sami Tara
Umar Vera Wim Yara Zoe Aiko Bruno Chiara Dario Emil Farah Goran Hana Ivan Jana Kofi Lena Mateo Nora Oskar Priya Quinn
Rafael Sonja Tomas Ugo Valentina Wanda Xavier Yusuf Zelda Anton Bianca Carlos Dora Erik Fatima Gustav Helga Isak
Julia Kenji Liam Mina Nadia Omar Petra Ruben Selma Theo Uma Viktor Wendy Yoko Zara""".split()
SURNAMES = """Silva Novak Berg Costa Dahl Ekstrand Ferreira Gruber Horvat Ivanova Jansen Kowalski Lindqvist Moreau Nagy
Olsen Petrov Quint Rossi Schmidt Tanaka Urban Varga Weber Yilmaz Zeller Abbott Brandt Castillo Dufour Engel Fischer
Garcia Hofmann Ibarra Jovanovic Keller Lopez Mendes Nowak Ortiz Pereira Romero Santos Torres Vidal Walsh Young
Aydin Bauer Conti Duarte Eriksen Fontaine Galli Haas Iversen Jensen Krause Lambert Marino Nielsen""".split()
CITIES = """Lisbon Oslo Porto Vienna Prague Lyon Turin Leeds Ghent Kyoto Austin Denver Quito Lima Cairo Tunis Accra
Dakar Hanoi Perth Cork Bergen Malmo Graz Split Seville Bilbao Krakow Riga Tallinn Vilnius Zagreb Sofia Athens Izmir
Osaka Busan Taipei Manila Jakarta Nairobi Kigali Bogota Havana Halifax Calgary Boston Seattle Dublin Geneva""".split()
RECORD_TEMPLATES = (
    "{name} is {age} and lives in {city}.",
    "Meet {name}, a {age}-year-old from {city}.",
    "{city} is home to {name}, who is {age}.",
    "At {age}, {name} moved to {city}.",
    "{name} ({age}) works in {city}.",
    "Born {age} years ago, {name} now lives in {city}.",
)
RECORD_INSTRUCTION = "Extract the person's name, age and city as YAML: "


def record_splits(num_train: int, num_eval: int, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Train / held-out (instruction + sentence, YAML record) pairs of the `records` task, drawn with `seed`.

    A fifth of the first names and of the surnames (chosen by the seed) appear only in held-out rows."""
    rng = random.Random(seed)
    firsts, lasts = FIRST_NAMES[:], SURNAMES[:]
    rng.shuffle(firsts)
    rng.shuffle(lasts)
    cut_f, cut_l = len(firsts) // 5, len(lasts) // 5

    def draw(first_names, surnames, n):
        pairs = []
        for _ in range(n):
            person = {"name": f"{rng.choice(first_names)} {rng.choice(surnames)}", "age": rng.randint(18, 90),
                      "city": rng.choice(CITIES)}
            sentence = rng.choice(RECORD_TEMPLATES).format(**person)
            pairs.append((RECORD_INSTRUCTION + sentence, "\n".join(f"{k}: {v}" for k, v in person.items())))
        return pairs

    return draw(firsts[cut_f:], lasts[cut_l:], num_train), draw(firsts[:cut_f], lasts[:cut_l], num_eval)


TOPICS = {
    "sports": "match goal team coach score player league season referee stadium ball win".split(),
    "cooking": "recipe oven flour sugar butter salt bake pan stir dough sauce dinner".split(),
    "weather": "rain cloud storm sunny wind snow forecast cold warm humid thunder sky".split(),
    "music": "song guitar piano melody band concert album rhythm singer drum chord tune".split(),
}
FILLER = "the a this that our their was is very quite really again today we they it and".split()


def topic_sentences(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """n sentences of 6 to 12 words, each drawing about a third of its words from one topic (its label)."""
    rng = random.Random(seed)
    names = list(TOPICS)
    out = []
    for _ in range(n):
        label = rng.randrange(len(names))
        words = [rng.choice(TOPICS[names[label]]) if rng.random() < 0.35 else rng.choice(FILLER)
                 for _ in range(rng.randint(6, 12))]
        if not any(w in TOPICS[names[label]] for w in words):
            words[rng.randrange(len(words))] = rng.choice(TOPICS[names[label]])
        out.append((" ".join(words), label))
    return out


def train_word_tokenizer(texts: list[str], max_length: int = 64):
    """A word-level tokenizer trained on `texts` ([CLS] text [SEP], as BERT-style classifiers expect)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials))
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, core.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_length)


def classification_metrics(eval_pred) -> dict[str, float]:
    """Accuracy and macro F1 (the mean over classes of 2PR/(P+R), 0 for a class never predicted nor present)."""
    preds = np.asarray(eval_pred.predictions)
    preds = preds.argmax(-1) if preds.ndim > 1 else preds
    labels = np.asarray(eval_pred.label_ids)
    f1 = []
    for c in np.union1d(labels, preds):
        tp = np.sum((preds == c) & (labels == c))
        denom = np.sum(preds == c) + np.sum(labels == c)
        f1.append(2 * tp / denom if denom else 0.0)
    return {"accuracy": float((preds == labels).mean()), "f1": float(np.mean(f1))}


def encode_completion(tokenizer, prompt: str, answer: str) -> dict[str, list[int]]:
    """Tokens of '<s>prompt answer</s>' with labels on the answer and </s> only (the prompt is given)."""
    p = [tokenizer.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False)
    a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return {"input_ids": p + a, "attention_mask": [1] * (len(p) + len(a)), "labels": [-100] * len(p) + a}


def argmax_logits(logits, labels):
    """preprocess_logits_for_metrics: keep the argmax only, so evaluation never stores [N, T, vocab]."""
    return logits.argmax(dim=-1)


def answer_metrics(eval_pred) -> dict[str, float]:
    """Token accuracy and exact match over the labelled (answer) positions of a causal LM.

    Predictions are teacher-forced argmaxes; an answer whose every token is predicted from the true prefix is
    exactly the answer greedy decoding would produce, so exact match here equals greedy-generation accuracy.
    """
    preds = np.asarray(eval_pred.predictions)[:, :-1]
    labels = np.asarray(eval_pred.label_ids)[:, 1:]
    mask = labels != -100
    hit = (preds == labels) & mask
    per_row = hit.sum(1) == mask.sum(1)
    return {"token_accuracy": float(hit.sum() / max(mask.sum(), 1)),
            "exact_match": float(per_row[mask.any(1)].mean())}
