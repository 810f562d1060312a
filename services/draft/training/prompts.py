"""Training prompts for the draft: varied tasks written here (never Spec-Bench, the test set).

Prompts are built from task templates and topics with a seeded random generator, so the same
seed gives the same prompts. The target answers them; the draft learns the target's answers.
"""

from __future__ import annotations

import random

TOPICS = [
    "the water cycle", "black holes", "the French Revolution", "photosynthesis", "machine learning",
    "climate change", "the Roman Empire", "volcanoes", "the human heart", "electric cars",
    "coffee", "the Internet", "honey bees", "the Moon landing", "renewable energy", "chess",
    "the immune system", "ancient Egypt", "jazz music", "the stock market", "rainforests",
    "vaccines", "the printing press", "earthquakes", "dinosaurs", "quantum computing",
    "the Great Wall of China", "recycling", "sleep", "social media", "the Olympic Games",
    "plate tectonics", "the Renaissance", "antibiotics", "bread baking", "mountain climbing",
    "the solar system", "democracy", "whales", "time management", "public libraries",
    "the Silk Road", "glaciers", "nuclear power", "gardening", "the piano", "friendship",
    "electricity", "smartphones", "the ocean tides", "birds migrating", "inflation",
    "space telescopes", "meditation", "the Industrial Revolution", "bicycles", "tea ceremonies",
    "DNA", "wind turbines", "city parks", "robots", "deserts", "the history of writing",
    "learning a new language", "remote work", "healthy breakfasts", "saving money",
    "video games", "volunteering", "the metric system", "airplanes", "lighthouses", "fungi",
]

NAMES = ["Alice", "Ben", "Chen", "Dana", "Emeka", "Fatima", "Gus", "Hana", "Ivan", "Julia",
         "Kofi", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]

PLACES = ["a small fishing village", "a space station", "a busy train station", "an old library",
          "a mountain cabin", "a desert oasis", "a floating city", "a school science fair",
          "a night market", "a lighthouse during a storm", "a bakery at dawn", "a museum at night"]

LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]

SENTENCES = [
    "The weather is beautiful today and we are going to the beach.",
    "Could you tell me where the nearest train station is?",
    "I have been learning to cook for three months.",
    "The meeting has been moved to Thursday afternoon.",
    "My brother loves reading books about history.",
    "Please remember to close the window before you leave.",
    "We planted tomatoes and beans in the garden this spring.",
    "The concert was cancelled because of the heavy rain.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "merges two sorted lists", "finds the largest element of a list",
    "removes duplicates from a list while keeping the order", "computes the factorial of n",
    "checks whether a word is a palindrome", "converts Celsius to Fahrenheit",
    "flattens a nested list", "counts word frequencies in a text", "performs binary search",
    "validates an email address with a simple rule", "sums the digits of an integer",
    "transposes a matrix", "returns the greatest common divisor of two numbers",
    "sorts a list of dictionaries by a key", "reads a CSV file and prints each row",
    "implements a simple stack class",
]

CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Java", "Go", "Rust", "SQL", "bash"]

TEMPLATES = [
    "Explain {topic} to a ten-year-old.",
    "Write a short essay about {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Give me five interesting facts about {topic}.",
    "Summarize the history of {topic} in a few paragraphs.",
    "Write a poem about {topic}.",
    "Write a short story set in {place} where {name} discovers something about {topic}.",
    "Compare {topic} and {topic2}. How are they similar and how are they different?",
    "Write a blog post introduction about {topic}.",
    "What are common misconceptions about {topic}?",
    "Create a study guide with key points about {topic}.",
    "Write an email from {name} to a colleague proposing a workshop on {topic}.",
    "Describe a day in the life of someone who works with {topic}.",
    "List the steps someone should take to learn about {topic}.",
    "Write a dialogue between {name} and {name2} arguing about {topic}.",
    "You are a tour guide in {place}. Welcome the visitors and tell them about {topic}.",
    "Pretend you are {name}, a scientist who studies {topic}. Introduce yourself and your work.",
    "Write a product description for a board game about {topic}.",
    "Answer briefly: why does {topic} matter today?",
    "Write three quiz questions about {topic}, with answers.",
    "Summarize the following text in two sentences: {paragraph}",
    "Rewrite this paragraph in a more formal tone: {paragraph}",
    "Extract the key points from this text as a bulleted list: {paragraph}",
    "Translate into {language}: {sentence}",
    "Translate the following sentence into {language} and explain any difficult words: {sentence}",
    "Correct the grammar of this sentence: {broken}",
    "Write a {code_lang} function that {code_task}.",
    "Write a {code_lang} function that {code_task}, and explain how it works.",
    "What is wrong with this code, and how would you fix it?\n```python\n{buggy}\n```",
    "Explain what this code does:\n```python\n{snippet}\n```",
    "{name} has {a} apples and buys {b} more. She gives {c} to {name2}. How many apples does she have now? Explain step by step.",
    "A train travels {a} kilometers in {b} hours. What is its average speed? Show your reasoning.",
    "What is {a} multiplied by {b}, plus {c}? Think step by step.",
    "A shop sells pens for {c} dollars each. How much do {a} pens cost, and how much change is left from {d} dollars?",
    "Solve for x: {a}x + {b} = {d}. Explain each step.",
    "If a rectangle is {a} meters long and {b} meters wide, what are its area and perimeter?",
    "{name} is older than {name2}, and {name2} is older than {name3}. Who is the youngest? Explain.",
    "Give me a plan for a weekend trip to {place}.",
    "What would happen if {topic} disappeared tomorrow? Reason about it.",
    "Write a limerick about {name} and {topic}.",
    "Give advice to a student who wants to write a report on {topic}.",
    "Write a recipe that a child could follow, inspired by {topic}.",
    "Describe {place} in vivid detail.",
    "Tell me a joke about {topic}, then explain why it is funny.",
]

BUGGY = [
    "def average(xs):\n    return sum(xs) / len(xs) + 1",
    "def last(xs):\n    return xs[len(xs)]",
    "for i in range(10)\n    print(i)",
    "def is_even(n):\n    return n % 2 == 1",
    "def greet(name):\n    print('Hello, ' + name",
]

SNIPPETS = [
    "squares = [x * x for x in range(10) if x % 2 == 0]",
    "def f(d):\n    return {v: k for k, v in d.items()}",
    "import collections\ncounts = collections.Counter(text.split())\nprint(counts.most_common(3))",
    "with open('data.txt') as fh:\n    lines = [line.strip() for line in fh if line.strip()]",
    "def memo(fn):\n    cache = {}\n    def inner(n):\n        if n not in cache:\n            cache[n] = fn(n)\n        return cache[n]\n    return inner",
]


def _paragraph(rng: random.Random) -> str:
    t1, t2 = rng.sample(TOPICS, 2)
    name = rng.choice(NAMES)
    return (f"{name} spent the summer reading about {t1}. At first the subject seemed difficult, but "
            f"after a few weeks {name} noticed connections with {t2}. By the end of the season, "
            f"{name} had written a long report and presented it to the local community, which "
            f"asked many questions about both subjects.")


def _broken(rng: random.Random) -> str:
    return rng.choice(["me and him goes to the store yesterday", "she don't like apples no more",
                       "their going to there house tomorow", "the childs was playing in the park",
                       "I has three cat and one dogs"])


def topic_words(tokenizer, min_letters: int = 6) -> list[str]:
    """Whole lowercase words in the tokenizer's vocabulary (tokens that start a word: a leading
    byte-level "Ġ" or SentencePiece "▁"), sorted: thousands of subjects beside TOPICS' few dozen."""
    words = set()
    for token in tokenizer.get_vocab():
        word = token[1:] if token[:1] in ("Ġ", "▁") else ""
        if len(word) >= min_letters and word.isascii() and word.isalpha() and word.islower():
            words.add(word)
    return sorted(words)


def make_prompts(n: int, seed: int = 0, words: list[str] = (), word_share: float = 0.0) -> list[str]:
    """n distinct prompts from the templates (deterministic for a seed). With `words`, a prompt's
    topics are two of them with probability `word_share`, else two of TOPICS, so the answers
    range over far more subjects than the templates' own (for the feature head this generalized
    to Spec-Bench no better than more template prompts: BENCHMARKS.md)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        names = rng.sample(NAMES, 3)
        t1, t2 = rng.sample(words if words and rng.random() < word_share else TOPICS, 2)
        a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 20)
        prompt = rng.choice(TEMPLATES).format(
            topic=t1, topic2=t2, name=names[0], name2=names[1], name3=names[2],
            place=rng.choice(PLACES), language=rng.choice(LANGUAGES), sentence=rng.choice(SENTENCES),
            paragraph=_paragraph(rng), broken=_broken(rng), code_lang=rng.choice(CODE_LANGS),
            code_task=rng.choice(CODE_TASKS), buggy=rng.choice(BUGGY), snippet=rng.choice(SNIPPETS),
            a=a, b=b, c=c, d=a * b + c + rng.randint(0, 50))
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


# News prompts: people, places and organizations with made-up names (split into several rare
# tokens, so no draft can know them: it has to copy them from the prompt or the text so far), and
# dates and figures. Spec-Bench's summaries and documents are news of this kind; the templates'
# common first names are single tokens a draft predicts without copying.
ONSETS = ["b", "br", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "ch", "sh"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou"]
CODAS = ["", "", "", "", "n", "r", "l", "s", "k", "m", "nd"]
ROLES = ["mayor", "head teacher", "fire chief", "chief engineer", "city treasurer", "hospital director",
         "police spokesperson", "harbour master", "union leader", "museum curator"]
PROJECTS = ["a new bridge", "the old rail line", "a flood barrier", "a public library", "solar panels on every school",
            "a children's hospital wing", "the market square", "a water treatment plant", "free bus passes"]
ORG_KINDS = ["Institute", "Foundation", "Trust", "Council", "Society", "Group", "Bank", "Laboratories"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NEWS_TEMPLATES = [
    "Write a news report about {person}, the {role} of {town}, who announced on {date} that {town} will "
    "spend {amount} on {project}. Quote {person} and {person2}.",
    "Write a news article: {person2}, a {age}-year-old from {town}, won the {org} prize on {date} with a "
    "score of {a}.{b}. Include quotes from {person}, who organized it.",
    "Write a press release from the {org} announcing that {person} will lead its new office in {town} from {date}.",
    "Write a news story about a storm that hit {town} on {date}: {a} homes lost power and {person}, the {role}, "
    "spoke to reporters. Mention {person2} too.",
    "Write a news article about a report by the {org}, published on {date}, which found that {b}% of the people "
    "of {town} {finding}. Its author is {person}.",
    "Write an obituary for {person}, who founded the {org} in {town} in {year} and led it for {b} years.",
    "Write a sports report: {town} beat {town2} {c}-{g} on {date}; {person} scored twice and {person2} once.",
    "Write a court report: on {date}, {person} of {town} was fined {amount} for damaging {project}. "
    "Quote the judge, {person2}.",
]
FINDINGS = ["walk to work", "cannot afford their rent", "have never visited the coast", "own an electric car",
            "read a newspaper every day", "want a new school", "grow their own vegetables"]


def made_up_name(rng: random.Random, syllables: tuple[int, int] = (2, 2)) -> str:
    """A capitalized word of consonant-vowel syllables ("Bromrus"): a name no vocabulary holds."""
    parts = [rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.randint(*syllables))]
    return "".join(parts).capitalize()


def make_news_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct news prompts (deterministic for a seed) about made-up people, towns and
    organizations, with dates and figures: answers that repeat names the draft must copy."""
    rng = random.Random(seed + 4)
    out, seen = [], set()
    while len(out) < n:
        person, person2 = (f"{made_up_name(rng, (1, 2))} {made_up_name(rng)}" for _ in range(2))
        a, b, c = rng.randint(2, 900), rng.randint(2, 99), rng.randint(2, 9)
        prompt = rng.choice(NEWS_TEMPLATES).format(
            person=person, person2=person2, town=made_up_name(rng), town2=made_up_name(rng),
            org=f"{made_up_name(rng)} {rng.choice(ORG_KINDS)}", role=rng.choice(ROLES), project=rng.choice(PROJECTS),
            date=f"{rng.choice(MONTHS)} {rng.randint(1, 28)}", year=rng.randint(1890, 2015), age=rng.randint(9, 90),
            amount=f"{rng.randint(2, 95)}.{rng.randint(0, 9)} million dollars", finding=rng.choice(FINDINGS),
            a=a, b=b, c=c, g=rng.randint(0, c - 1))
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


# Second-stage prompts: tasks over a passage the target wrote in the first stage (summaries,
# questions over documents, extraction, translation back to English), the kinds of answer that
# copy from their prompt, which template prompts alone rarely ask for.
PASSAGE_TEMPLATES = [
    "Summarize: {passage}",
    "Summarize the following text in a few sentences.\n\n{passage}",
    "{passage}\n\nWhat is the main point of the text above? Answer in one or two sentences.",
    "Read the document and answer the question.\n\nDocument: {passage}\n\nQuestion: {question}",
    "{passage} {passage2}\n\n{question}",
    "Extract every name, place and number mentioned in this text, one per line.\n\n{passage}",
    "List the key facts of this text as bullet points.\n\n{passage}",
    "Rewrite the following text in simpler words.\n\n{passage}",
    "Continue this text with one more paragraph.\n\n{passage}",
]
LONG_TEMPLATES = [
    "Summarize the following article in a few sentences.\n\n{document}",
    "{document}\n\nWrite a short summary of the article above, naming the people and places in it.",
    "Answer the question using the documents below.\n\n{document}\n\nQuestion: {question}",
]
FOREIGN_TEMPLATES = ["Write a few sentences in {language} about {topic}.",
                     "Describe {topic} in {language}, in one short paragraph."]
QUESTIONS = ["What is this text about?", "Why does {topic} matter, according to the text?",
             "Who or what is mentioned first in the text?", "What happens at the end of the text?",
             "Which details in the text are the most surprising?", "What can we learn about {topic}?"]


def make_foreign_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (prompt, language) asking for text in another language (translated back later)."""
    rng = random.Random(seed + 1)
    languages = [rng.choice(LANGUAGES) for _ in range(n)]
    return [(rng.choice(FOREIGN_TEMPLATES).format(language=lang, topic=rng.choice(TOPICS)), lang)
            for lang in languages]


def make_passage_prompts(passages: list[str], foreign: list[tuple[str, str]], n: int, seed: int = 0,
                         max_chars: int = 1500, long_share: float = 0.0) -> list[str]:
    """n prompts over the first stage's answers: `passages` (English) and `foreign` (text, its
    language), to be translated as Spec-Bench asks ("Translate German to English: ..."). With
    `long_share`, that share of the others are long documents (three passages, several hundred
    tokens, as Spec-Bench's articles are) to summarize or answer a question over."""
    rng = random.Random(seed + 2)
    out = []
    for _ in range(n):
        if foreign and rng.random() < 0.15:
            text, language = rng.choice(foreign)
            out.append(f"Translate {language} to English: {text[:max_chars]}")
            continue
        if long_share and len(passages) >= 3 and rng.random() < long_share:
            document = "\n\n".join(p[:max_chars] for p in rng.sample(passages, 3))
            question = rng.choice(QUESTIONS).format(topic=rng.choice(TOPICS))
            out.append(rng.choice(LONG_TEMPLATES).format(document=document, question=question))
            continue
        p1, p2 = rng.sample(passages, 2)
        question = rng.choice(QUESTIONS).format(topic=rng.choice(TOPICS))
        out.append(rng.choice(PASSAGE_TEMPLATES).format(passage=p1[:max_chars], passage2=p2[: max_chars // 2],
                                                        question=question))
    return out
