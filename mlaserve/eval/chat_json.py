"""The demo model's JSON family: compact JSON answers to questions asked for JSON, extracted
from text or made up under a schema (`chat_families` has the conversation they form)."""

import random

from mlaserve.eval import tasks as T
from mlaserve.eval.chat_families import (
    Conversation,
    Plain,
    compact,
    plain_arithmetic,
    plain_extreme,
    plain_problem,
)

# -- JSON answers: compact objects, the values sensible, every string and bracket closed --
NAMES = ("Alice", "Bob", "Carol", "Dave", "Emma", "Frank", "Grace", "Henry", "Tom", "Anna", "Ben",
         "Mia", "Sam", "Lily", "Max", "Zoe", "Leo", "Ivy", "Omar", "Nina", "Paul", "Sara")
CITIES = {"Paris": "France", "London": "England", "Oslo": "Norway", "Tokyo": "Japan",
          "Berlin": "Germany", "Rome": "Italy", "Madrid": "Spain", "Lisbon": "Portugal",
          "Vienna": "Austria", "Prague": "Czechia", "Dublin": "Ireland", "Cairo": "Egypt",
          "Lima": "Peru", "Boston": "USA", "Chicago": "USA", "Toronto": "Canada",
          "Sydney": "Australia", "Seoul": "Korea", "Delhi": "India", "Nairobi": "Kenya",
          "Athens": "Greece", "Warsaw": "Poland", "Zurich": "Switzerland", "Mexico City": "Mexico",
          "New York": "USA", "Cape Town": "South Africa", "Buenos Aires": "Argentina"}
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday", "today",
        "tomorrow", "May 3", "June 12", "next week")
EVENTS = ("science fair", "birthday party", "team meeting", "concert", "football match",
          "book club", "dinner", "picnic", "job interview", "yoga class", "chess tournament",
          "school trip", "wedding", "lunch")
COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
WORDS = ("yes", "no", "none", "unknown", "ok", "done", "small", "large", "fast", "slow", "good",
         "new", "old", "open", "closed", "high", "low", "hello", "blue sky", "a short note",
         "red car", "green tea", "see you soon", "all good", "not sure", "in progress")
KEYS = ("name", "title", "id", "count", "total", "score", "level", "status", "color", "size",
        "city", "country", "tags", "items", "notes", "label", "type", "kind", "category",
        "priority", "enabled", "active", "valid", "done", "age", "year", "price", "quantity",
        "description", "summary", "reason", "comment", "message", "text", "value", "result",
        "answer", "data", "info", "details", "user", "owner", "author", "email", "address",
        "street", "zip", "code", "date", "time", "day", "unit", "language", "topic", "rating",
        "rank", "number", "mode", "source", "target", "first", "second", "min", "max", "start",
        "end", "explanation", "output", "steps", "final_answer", "confidence", "is_correct",
        "items_list", "full_name", "first_name", "last_name", "phone", "location", "event",
        "participants", "people", "members", "keywords", "options", "values", "parts")
SYLLABLES = ("ka", "lo", "mi", "ter", "zu", "ran", "bel", "do", "fi", "sen", "ko", "pa", "ri",
             "vo", "na", "gel")
JSON_SYSTEMS = ("Reply with a JSON object.", "Respond in JSON.", "Answer in JSON.",
                "You reply with JSON only.", "Output a JSON object.",
                "You are a helpful assistant. Reply in JSON.", "Return your answer as a JSON "
                "object.", "You are an API that answers in JSON.", "Always answer with JSON.",
                "Answer with a JSON object and nothing else.", "Extract the information as JSON.",
                "You are a helpful assistant designed to output JSON.")
JSON_SUFFIXES = (" Reply in JSON.", " Answer in JSON.", " Respond with a JSON object.",
                 " Give the answer as JSON.", " Return JSON.", "\nReply with a JSON object.",
                 " (JSON)", " Answer as a JSON object.", "\n\nRespond in JSON.")
UNASKED_SYSTEMS = ("You are a helpful assistant.", "You are a helpful math tutor. Guide the user "
                   "through the solution step by step.", "Extract the event information.",
                   "Extract the information.", "You are a helpful assistant that extracts data.",
                   "You are a useful assistant.")


def random_key(rng: random.Random) -> str:
    if rng.random() < 0.8:
        return rng.choice(KEYS)
    key = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
    return key if rng.random() < 0.5 else key + "_" + rng.choice(KEYS)


KEY_VALUES = {
    ("name", "full_name", "first_name", "author", "owner", "user"): lambda rng: rng.choice(NAMES),
    ("city", "location"): lambda rng: rng.choice(tuple(CITIES)),
    ("country",): lambda rng: rng.choice(tuple(CITIES.values())),
    ("email",): lambda rng: f"{rng.choice(NAMES).lower()}@example.com",
    ("age", "count", "quantity", "number", "score", "rank", "level", "total", "price", "year",
     "min", "max", "rating"): lambda rng: rng.randint(1, 99),
    ("color",): lambda rng: rng.choice(COLORS),
    ("day", "date", "time"): lambda rng: rng.choice(DAYS),
    ("valid", "active", "enabled", "done", "is_correct"): lambda rng: rng.random() < 0.5,
    ("tags", "keywords", "options", "values", "items_list"):
        lambda rng: rng.sample(WORDS[:16], rng.randint(1, 3)),
    ("people", "participants", "members"): lambda rng: rng.sample(NAMES, rng.randint(1, 3)),
}
VALUE_OF_KEY = {key: make for keys, make in KEY_VALUES.items() for key in keys}


def random_value(rng: random.Random, words: list[str], depth: int = 0, key: str = ""):
    """A value for `key`: most often one that fits the key (a name for "name", a number for
    "age"), else of a random type: short strings (often the question's words), small numbers,
    booleans, and (above depth 2 no more) objects and arrays of 1-3 items."""
    if key in VALUE_OF_KEY and rng.random() < 0.8:
        return VALUE_OF_KEY[key](rng)
    kind = rng.choices(("string", "integer", "number", "boolean", "null", "object", "array"),
                       (0.4, 0.2, 0.04, 0.12, 0.02, 0.1 if depth < 2 else 0,
                        0.12 if depth < 2 else 0))[0]
    if kind == "string":
        pools = [words, NAMES, tuple(CITIES), COLORS, WORDS, DAYS]
        return rng.choice(rng.choice([p for p in pools if p]))
    if kind == "integer":
        return rng.randint(0, 99) if rng.random() < 0.8 else rng.randint(100, 9999)
    if kind == "number":
        return round(rng.uniform(0, 100), rng.choice((1, 2)))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "object":
        return random_object(rng, words, rng.randint(1, 3), depth + 1)
    item_kind = rng.random()
    count = rng.choice((1, 1, 2, 2, 3))
    if item_kind < 0.5:
        pool = rng.choice([p for p in (words, NAMES, tuple(CITIES), COLORS, WORDS) if p])
        return [rng.choice(pool) for _ in range(count)]
    if item_kind < 0.75:
        return [rng.randint(0, 99) for _ in range(count)]
    keys = [random_key(rng) for _ in range(rng.randint(1, 2))]  # one schema for every item
    return [{k: random_value(rng, words, depth + 2, k) for k in keys} for _ in range(count)]


def random_object(rng: random.Random, words: list[str], size: int, depth: int = 0) -> dict:
    out = {}
    while len(out) < size:
        key = random_key(rng)
        out[key] = random_value(rng, words, depth, key)
    return out


def _op_words(step: str) -> str:
    a, op, b = step.split()
    return {"+": f"Add {b} to {a}.", "-": f"Subtract {b} from {a}.",
            "*": f"Multiply {a} by {b}."}[op]


def arithmetic_object(rng: random.Random, problem: Plain) -> dict:
    """An arithmetic answer as JSON: the answer alone, with the expression, with its steps (as
    OpenAI's MathReasoning example: steps of explanation and output, final_answer)."""
    value, steps = problem.value, problem.steps
    expression = steps[0][0] if len(steps) == 1 else problem.answer.split(" = ")[0]
    form = rng.random()
    if form < 0.35:
        op = steps[0][0].split()[1] if len(steps) == 1 else None
        keys = ["answer", "answer", "result", "value", "total", "final_answer", "solution"]
        if op:
            keys.append({"+": "sum", "-": "difference", "*": "product"}[op])
        return {rng.choice(keys): value if rng.random() < 0.7 else str(value)}
    if form < 0.5:
        return {rng.choice(("expression", "question", "problem")): expression,
                rng.choice(("result", "answer", "value")): value}
    if form < 0.8:
        explanation, output, steps_key, final = (
            ("explanation", "output", "steps", "final_answer") if rng.random() < 0.6 else
            (rng.choice(("step", "description", "text")), rng.choice(("result", "value")),
             rng.choice(("steps", "work", "reasoning")), rng.choice(("answer", "result"))))
        return {steps_key: [{explanation: _op_words(step),
                             output: f"{step} = {result}" if rng.random() < 0.5 else str(result)}
                            for step, result in steps],
                final: str(value) if rng.random() < 0.7 else value}
    return {"steps": [f"{step} = {result}" for step, result in steps],
            rng.choice(("answer", "result")): value}


def extreme_object(rng: random.Random, problem: Plain) -> dict:
    which = problem.answer.split()[1]  # "The largest is 30."
    form = rng.random()
    if form < 0.4:
        return {rng.choice((which, "answer", "result")): problem.value}
    if form < 0.7:
        return {"numbers": problem.numbers, which: problem.value}
    other = "smallest" if which == "largest" else "largest"
    pick = min if other == "smallest" else max
    return {which: problem.value, other: pick(problem.numbers)}


def extraction(rng: random.Random) -> tuple[str, dict]:
    """A sentence and the object that holds its facts."""
    people = rng.sample(NAMES, rng.choice((1, 2, 2, 3)))
    together = people[0] if len(people) == 1 else ", ".join(people[:-1]) + " and " + people[-1]
    city, event, day = rng.choice(tuple(CITIES)), rng.choice(EVENTS), rng.choice(DAYS)
    on_day = day if day in ("today", "tomorrow", "next week") else f"on {day}"
    n = rng.randint(2, 60)
    kind = rng.randrange(7)
    if kind == 0:
        verb = "is" if len(people) == 1 else "are"
        return (f"{together} {verb} going to a {event} {on_day}.",
                {rng.choice(("name", "event", "title")): event,
                 rng.choice(("date", "day", "when")): day,
                 rng.choice(("participants", "people", "attendees")): people})
    if kind == 1:
        age = rng.randint(5, 90)
        person = people[0]
        shape = rng.random()
        if shape < 0.4:
            return (f"{person} is {age} years old and lives in {city}.",
                    {"name": person, "age": age, "city": city})
        if shape < 0.7:
            return (f"{person} is {age} years old and lives in {city}.",
                    {"name": person, "age": age, "address": {"city": city,
                                                             "country": CITIES[city]}})
        return (f"{person} is {age} years old and lives in {city}.",
                {"person": {"name": person, "age": age}, "city": city})
    if kind == 2:
        obj = rng.choice(T.OBJECTS)
        if rng.random() < 0.5:
            return f"{people[0]} has {n} {obj}.", {"name": people[0], "count": n, "item": obj}
        return (f"{people[0]} has {n} {obj}.",
                {"owner": people[0], "items": [{"name": obj, "count": n}]})
    if kind == 3:
        obj, price = rng.choice(T.OBJECTS), rng.randint(1, 99)
        return (f"{people[0]} bought {n} {obj} for {price} dollars.",
                {"buyer": people[0], "item": obj, "quantity": n, "price": price})
    if kind == 4:
        email = f"{people[0].lower()}@example.com"
        return (f"My name is {people[0]} and my email is {email}.",
                {"name": people[0], "email": email})
    if kind == 5:
        if rng.random() < 0.5:
            return (f"The {event} is in {city} {on_day}.",
                    {"event": event, "city": city, "day": day})
        return (f"The {event} is in {city} {on_day}.",
                {"event": event, "location": {"city": city}, "date": day})
    colors = rng.sample(COLORS, rng.randint(1, 3))
    liked = colors[0] if len(colors) == 1 else ", ".join(colors[:-1]) + " and " + colors[-1]
    return f"{people[0]} likes {liked}.", {"name": people[0], "colors": colors}


def generic_request(rng: random.Random) -> tuple[str, dict]:
    """A request whose answer is made up: a city, a user, a product, a to-do item."""
    city, person = rng.choice(tuple(CITIES)), rng.choice(NAMES)
    kind = rng.randrange(5)
    if kind == 0:
        return (rng.choice(("Describe {c}.", "Tell me about {c}.", "Where is {c}?")).format(c=city),
                {"city": city, "country": CITIES[city]})
    if kind == 1:
        return (rng.choice(("Give me a random user.", "Make up a person.", "Create a user.")),
                {"name": person, "age": rng.randint(18, 80),
                 "email": f"{person.lower()}@example.com", "active": rng.random() < 0.5})
    if kind == 2:
        obj = rng.choice(T.OBJECTS)
        return (rng.choice(("Make up a product.", "Describe a product for sale.")),
                {"name": obj, "price": rng.randint(1, 99), "in_stock": rng.random() < 0.5,
                 "tags": rng.sample(WORDS[:16], rng.randint(1, 3))})
    if kind == 3:
        task = rng.choice(("buy milk", "call mom", "clean the kitchen", "read a book",
                           "pay the bills", "walk the dog"))
        return (rng.choice(("Create a to-do item: {t}.", "Add a task to {t}.")).format(t=task),
                {"title": task, "done": False})
    color = rng.choice(COLORS)
    return (rng.choice(("Suggest a color.", "Pick a color.", "What is your favourite color?")),
            {"color": color})


def json_object_for(rng: random.Random) -> tuple[str, dict]:
    """A question (without the instruction) and the JSON object that answers it."""
    topic = rng.random()
    if topic < 0.35:
        problem = plain_arithmetic(rng)
        question, obj = problem.question, arithmetic_object(rng, problem)
    elif topic < 0.45:
        problem = plain_extreme(rng)
        question, obj = problem.question, extreme_object(rng, problem)
    elif topic < 0.7:
        question, obj = extraction(rng)
    elif topic < 0.82:
        question, obj = generic_request(rng)
    else:
        question = rng.choice(("Fill in the form.", "Give me some data.", "Return an object.",
                               "Make up an example.", "Generate a record.",
                               plain_problem(rng).question, extraction(rng)[0]))
        obj = random_object(rng, [w for w in question.rstrip(".?").split() if w.isalpha()],
                            rng.randint(1, 4))
    if rng.random() < 0.2:  # a schema with fields the question says nothing of
        words = [w for w in question.rstrip(".?").split() if w.isalpha()]
        items = list(obj.items())
        for _ in range(rng.randint(1, 2)):
            key = random_key(rng)
            if key not in obj:
                items.insert(rng.randint(0, len(items)), (key, random_value(rng, words, 0, key)))
        obj = dict(items)
    return question, obj


def json_conversation(rng: random.Random) -> Conversation:
    """A question answered with a compact JSON object. Asked for JSON by a system message or a
    suffix, the whole object is the target; not asked (a structured-output request whose
    grammar forces the `{`), everything after the `{` is."""
    how = rng.random()
    messages, targets = [], {}
    if how < 0.45:
        messages.append({"role": "system", "content": rng.choice(JSON_SYSTEMS)})
        if rng.random() < 0.2:  # an earlier question, answered in JSON too
            question, obj = json_object_for(rng)
            messages.append({"role": "user", "content": question})
            targets[len(messages)] = 0
            messages.append({"role": "assistant", "content": compact(obj)})
    elif how > 0.75 and rng.random() < 0.6:
        messages.append({"role": "system", "content": rng.choice(UNASKED_SYSTEMS)})
    question, obj = json_object_for(rng)
    if 0.45 <= how < 0.75:
        question += rng.choice(JSON_SUFFIXES)
    messages.append({"role": "user", "content": question})
    targets[len(messages)] = 1 if how >= 0.75 else 0
    messages.append({"role": "assistant", "content": compact(obj)})
    return Conversation(messages, None, targets)
