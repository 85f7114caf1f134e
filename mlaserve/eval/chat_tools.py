"""The demo model's tool-call family: tools of a few kinds, requests that need one or two
calls, the calls in DeepSeek-V3's format or as the forced-choice JSON array, and the answers after
the results (`chat_families` has the conversation they form)."""

import random
from collections.abc import Callable
from dataclasses import dataclass

from mlaserve.eval.chat_families import Conversation, compact, plain_problem
from mlaserve.eval.chat_json import CITIES, NAMES


# -- tool calls: DeepSeek-V3's format, "required"'s JSON array, a named function's arguments --
@dataclass
class ToolUse:
    """One call a request needs: the function's name, its arguments (in the schema's order),
    the request's words, the tool's result and a short answer that uses it."""

    name: str
    arguments: dict
    request: str
    result: str
    reply: str


@dataclass
class ToolKind:
    """A family of functions: name and description variants, parameters (name variants and a
    schema each; `optional` ones are added to some) and a maker of uses: make(rng, the chosen
    [(parameter name, schema)]) -> (arguments, request, result, reply)."""

    names: tuple[str, ...]
    descriptions: tuple[str | None, ...]
    parameters: tuple[tuple[tuple[str, ...], dict], ...]
    make: Callable
    optional: tuple[tuple[tuple[str, ...], dict], ...] = ()


def _schema(rng: random.Random, properties: list[tuple[str, dict]], title: str) -> dict:
    """A parameters schema in one of the shapes clients send (plain, strict, pydantic's with
    titles, with property descriptions)."""
    style = rng.random()
    if style < 0.2:  # pydantic's: titles, keys sorted as pydantic writes them
        return {"properties": {n: {"title": n.replace("_", " ").title(), **s}
                               for n, s in properties},
                "required": [n for n, _ in properties], "title": title, "type": "object",
                "additionalProperties": False}
    if style < 0.35:
        described = {n: {**s, "description": f"The {n.replace('_', ' ')}"} for n, s in properties}
        return {"type": "object", "properties": described, "required": [n for n, _ in properties]}
    schema = {"type": "object", "properties": dict(properties)}
    if style < 0.9:
        schema["required"] = [n for n, _ in properties]
    if style > 0.7:
        schema["additionalProperties"] = False
    return schema


STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
DEFINITIONS = {"cat": "a small furry animal", "river": "a large stream of water",
               "happy": "feeling good", "book": "pages bound together", "storm": "strong wind "
               "and rain", "bridge": "a way across a river", "apple": "a round fruit",
               "quick": "fast", "ocean": "a very large sea", "lamp": "a light",
               "winter": "the cold season", "garden": "a place where plants grow",
               "friend": "a person you like", "cloud": "water drops in the sky",
               "piano": "a musical instrument", "tiny": "very small"}
SUBJECTS = ("Lunch", "Meeting tomorrow", "Hello", "The report", "Weekend plans", "Invoice",
            "Party on Friday", "Project update", "Dinner", "Holiday")
BODIES = ("See you at noon", "I will be late", "Thanks for your help", "Call me back",
          "The file is attached")
QUERIES = ("pizza places in Rome", "cheap flights to Oslo", "how to bake bread",
           "the tallest mountain", "python tutorials", "best hiking boots", "news about space",
           "train times to Berlin", "vegan recipes", "the history of chess")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "NOK", "CHF")
SYMBOLS = ("AAPL", "MSFT", "GOOG", "TSLA", "AMZN", "NVDA")
LANGUAGES = ("French", "German", "Spanish", "Italian", "Japanese", "Norwegian")
PHRASES = ("hello", "good morning", "thank you", "where is the station", "I like cats",
           "see you soon", "good night")
COUNTRIES = ("France", "Japan", "Norway", "Brazil", "Kenya", "Canada", "India", "Italy", "Peru")
RESTAURANTS = ("The Green Fork", "Sushi Bar", "Cafe Rosa", "Blue Door", "Pasta House")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "clear")


def _weather(rng, p):
    city = rng.choice(tuple(CITIES))
    args = {p[0][0]: city}
    ask = rng.choice(("What's the weather in {c}?", "What is the weather like in {c}?",
                      "How is the weather in {c} today?", "Is it raining in {c}?",
                      "Weather in {c}?", "Tell me the weather for {c}.",
                      "Do I need an umbrella in {c}?", "How warm is it in {c}?",
                      "Check the weather in {c}.", "what's the weather in {c}")).format(c=city)
    temperature, condition = rng.randint(-5, 35), rng.choice(CONDITIONS)
    if len(p) > 1:
        unit = rng.choice(p[1][1]["enum"])
        args[p[1][0]] = unit
        ask += rng.choice((" In {u}.", " Use {u}.", " ({u})")).format(u=unit)
    result = (compact({"temperature": temperature, "condition": condition}) if rng.random() < 0.6
              else f"{temperature} degrees, {condition}")
    return args, ask, result, f"It is {temperature} degrees and {condition} in {city}."


def _time(rng, p):
    city = rng.choice(tuple(CITIES))
    ask = rng.choice(("What time is it in {c}?", "What's the time in {c}?",
                      "Current time in {c}?", "Tell me the time in {c}.")).format(c=city)
    clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    return {p[0][0]: city}, ask, clock, f"It is {clock} in {city}."


def _arithmetic_tool(op):
    def make(rng, p):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if op == "-" and b > a:
            a, b = b, a
        if op == "*":
            b = rng.randint(2, 12)
        asks = {"+": ("Add {a} and {b}.", "What is {a} + {b}?", "Please add {a} and {b}.",
                      "What is the sum of {a} and {b}?", "Use the tool to add {a} and {b}.",
                      "Can you add {a} and {b}?", "{a} plus {b}?"),
                "-": ("Subtract {b} from {a}.", "What is {a} - {b}?", "What is {a} minus {b}?",
                      "Use the tool to subtract {b} from {a}."),
                "*": ("Multiply {a} by {b}.", "What is {a} times {b}?", "What is {a} * {b}?",
                      "Use the tool to multiply {a} and {b}.")}[op]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return ({p[0][0]: a, p[1][0]: b}, rng.choice(asks).format(a=a, b=b), str(value),
                f"{a} {op} {b} = {value}.")
    return make


def _lookup(rng, p):
    word = rng.choice(tuple(DEFINITIONS))
    ask = rng.choice(("Look up the word {w}.", "What does {w} mean?", "Define {w}.",
                      "What is the meaning of {w}?", "Look up {w}.",
                      "Find the definition of {w}.")).format(w=word)
    meaning = DEFINITIONS[word]
    return {p[0][0]: word}, ask, meaning, f"{word.capitalize()} means {meaning}."


def _email(rng, p):
    name = rng.choice(NAMES)
    to = f"{name.lower()}@example.com" if rng.random() < 0.7 else name
    subject = rng.choice(SUBJECTS)
    args = {p[0][0]: to, p[1][0]: subject}
    if len(p) > 2:
        body = rng.choice(BODIES)
        args[p[2][0]] = body
        ask = rng.choice(("Send an email to {t} with the subject {s} saying {b}.",
                          "Email {t} about {s}: {b}.")).format(t=to, s=subject, b=body)
    else:
        ask = rng.choice(("Send an email to {t} with the subject {s}.", "Email {t} about {s}.",
                          "Write an email to {t}, subject: {s}.",
                          "Please send {t} an email titled {s}.")).format(t=to, s=subject)
    result = rng.choice(("sent", compact({"status": "sent"})))
    return args, ask, result, f"I sent the email to {to}."


def _search(rng, p):
    query = rng.choice(QUERIES)
    ask = rng.choice(("Search the web for {q}.", "Search for {q}.",
                      "Find information about {q}.", "Look online for {q}.")).format(q=query)
    count = rng.randint(1, 9)
    return ({p[0][0]: query}, ask, f"{count} results", f"I found {count} results for {query}.")


def _convert(rng, p):
    amount = rng.randint(1, 500)
    source, target = rng.sample(CURRENCIES, 2)
    ask = rng.choice(("Convert {n} {a} to {b}.", "How much is {n} {a} in {b}?",
                      "Change {n} {a} into {b}.")).format(n=amount, a=source, b=target)
    converted = rng.randint(1, 900)
    return ({p[0][0]: amount, p[1][0]: source, p[2][0]: target}, ask, str(converted),
            f"{amount} {source} is {converted} {target}.")


def _timer(rng, p):
    minutes = rng.randint(1, 90)
    ask = rng.choice(("Set a timer for {n} minutes.", "Start a {n} minute timer.",
                      "Remind me in {n} minutes.", "Timer for {n} minutes please.")
                     ).format(n=minutes)
    return {p[0][0]: minutes}, ask, "ok", f"Your timer is set for {minutes} minutes."


def _stock(rng, p):
    symbol = rng.choice(SYMBOLS)
    ask = rng.choice(("What is the price of {s}?", "How much is {s} stock?",
                      "Get the stock price of {s}.", "What's {s} trading at?")).format(s=symbol)
    price = rng.randint(10, 900)
    return {p[0][0]: symbol}, ask, str(price), f"{symbol} is at {price} dollars."


def _translate(rng, p):
    phrase, language = rng.choice(PHRASES), rng.choice(LANGUAGES)
    ask = rng.choice(("Translate {t} to {l}.", "How do you say {t} in {l}?",
                      "Translate \"{t}\" into {l}.")).format(t=phrase, l=language)
    said = f"{phrase} ({language})"
    return {p[0][0]: phrase, p[1][0]: language}, ask, said, f"In {language}: {said}."


def _population(rng, p):
    country = rng.choice(COUNTRIES)
    ask = rng.choice(("What is the population of {c}?", "How many people live in {c}?",
                      "Population of {c}?")).format(c=country)
    millions = rng.randint(1, 300)
    return ({p[0][0]: country}, ask, f"{millions} million",
            f"{country} has about {millions} million people.")


def _book(rng, p):
    place, people = rng.choice(RESTAURANTS), rng.randint(1, 12)
    ask = rng.choice(("Book a table for {n} at {r}.", "Reserve a table at {r} for {n} people.",
                      "Get us a table for {n} at {r}.")).format(n=people, r=place)
    return ({p[0][0]: place, p[1][0]: people}, ask, "confirmed",
            f"Your table for {people} at {place} is booked.")


TOOL_KINDS = (
    ToolKind(("get_weather", "get_weather", "get_current_weather", "weather", "fetch_weather"),
             ("Get the current weather in a city.", "Get the weather for a location.",
              "Look up the weather.", "the weather in a city", None),
             ((("city", "city", "location", "place"), STRING),), _weather,
             ((("unit",), {"type": "string", "enum": ["celsius", "fahrenheit"]}),
              (("unit",), {"type": "string", "enum": ["c", "f"]}))),
    ToolKind(("get_time", "get_current_time", "current_time"),
             ("Get the current time in a city.", "The local time of a place.", None),
             ((("city", "location", "place"), STRING),), _time),
    ToolKind(("add", "add", "add_numbers", "sum"), ("Add two numbers.", "Return a + b.", None),
             ((("a", "a", "x", "first"), INTEGER), (("b", "b", "y", "second"), INTEGER)),
             _arithmetic_tool("+")),
    ToolKind(("subtract", "sub", "minus"), ("Subtract b from a.", "Return a - b.", None),
             ((("a", "x"), INTEGER), (("b", "y"), INTEGER)), _arithmetic_tool("-")),
    ToolKind(("multiply", "mul", "times"), ("Multiply two numbers.", "Return a * b.", None),
             ((("a", "x"), INTEGER), (("b", "y"), INTEGER)), _arithmetic_tool("*")),
    ToolKind(("lookup", "lookup", "define", "lookup_word", "dictionary"),
             ("Look up a word in the dictionary.", "Define a word.", None),
             ((("word", "word", "term"), STRING),), _lookup),
    ToolKind(("send_email", "send_email", "email", "send_mail"),
             ("Send an email.", "Send an email to someone.", None),
             ((("to", "to", "recipient"), STRING), (("subject", "subject", "title"), STRING)),
             _email, ((("body", "text", "message"), STRING),)),
    ToolKind(("search", "web_search", "search_web"), ("Search the web.", "Find pages.", None),
             ((("query", "query", "q"), STRING),), _search),
    ToolKind(("convert_currency", "convert", "exchange"),
             ("Convert an amount between currencies.", None),
             ((("amount",), NUMBER), (("from", "from_currency", "source"), STRING),
              (("to", "to_currency", "target"), STRING)), _convert),
    ToolKind(("set_timer", "start_timer", "timer"), ("Set a timer.", "Start a countdown.", None),
             ((("minutes", "minutes", "duration"), INTEGER),), _timer),
    ToolKind(("get_stock_price", "stock_price", "get_price"), ("Get a stock's price.", None),
             ((("symbol", "ticker"), STRING),), _stock),
    ToolKind(("translate", "translate_text"), ("Translate text.", "Translate a phrase.", None),
             ((("text", "phrase"), STRING), (("language", "target_language", "to"), STRING)),
             _translate),
    ToolKind(("get_population", "population"), ("Get the population of a country.", None),
             ((("country",), STRING),), _population),
    ToolKind(("book_table", "reserve_table", "make_reservation"),
             ("Book a table at a restaurant.", None),
             ((("restaurant", "place"), STRING), (("people", "guests", "party_size"), INTEGER)),
             _book),
)
ARITHMETIC_TOOLS = {2, 3, 4}  # indices in TOOL_KINDS of add, subtract, multiply
TOOL_SYSTEMS = ("You are a helpful assistant.", "You can call tools.",
                "Use the tools when they help.", "You are a helpful assistant with tools.")


class ToolChoice:
    """One function of a kind, with its name, description and parameter names chosen."""

    def __init__(self, rng: random.Random, kind: ToolKind) -> None:
        self.kind = kind
        self.name = rng.choice(kind.names)
        parameters = [(rng.choice(names), schema) for names, schema in kind.parameters]
        if kind.optional and rng.random() < 0.35:
            names, schema = rng.choice(kind.optional)
            parameters.append((rng.choice(names), schema))
        self.parameters = parameters
        function = {"name": self.name}
        description = rng.choice(kind.descriptions)
        if description:
            function["description"] = description
        title = "".join(part.title() for part in self.name.split("_"))
        function["parameters"] = _schema(rng, parameters, title)
        self.tool = {"type": "function", "function": function}

    def use(self, rng: random.Random) -> ToolUse:
        arguments, request, result, reply = self.kind.make(rng, self.parameters)
        return ToolUse(self.name, arguments, request, result, reply)


def _join_requests(rng: random.Random, requests: list[str]) -> str:
    if len(requests) == 1:
        return requests[0]
    second = requests[1][0].lower() + requests[1][1:]
    return requests[0] + rng.choice((" Also, ", " And ", " Then ", "\n")) + second


def tool_round(rng: random.Random, choices: list[ToolChoice], messages: list[dict],
               targets: dict[int, int], mode: str, answer: bool) -> None:
    """One request needing 1-2 calls, the assistant's calls (DeepSeek's format for "auto",
    the JSON array for "required", the arguments object for a named function) and, if
    `answer`, the tools' results and the assistant's short answer."""
    first = rng.choice(choices)
    uses = [first.use(rng)]
    if mode != "named" and rng.random() < 0.3:
        uses.append((first if rng.random() < 0.4 else rng.choice(choices)).use(rng))
    messages.append({"role": "user", "content": _join_requests(rng, [u.request for u in uses])})
    if mode == "required":
        targets[len(messages)] = 1
        messages.append({"role": "assistant", "content": compact(
            [{"name": u.name, "parameters": u.arguments} for u in uses])})
        return
    if mode == "named":
        targets[len(messages)] = 1
        messages.append({"role": "assistant", "content": compact(uses[0].arguments)})
        return
    targets[len(messages)] = 0
    ids = [f"call_{len(messages)}_{i}" for i in range(len(uses))]
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": u.name, "arguments": compact(u.arguments)}}
        for call_id, u in zip(ids, uses, strict=True)]})
    if answer:
        for call_id, use in zip(ids, uses, strict=True):
            messages.append({"role": "tool", "tool_call_id": call_id, "content": use.result})
        targets[len(messages)] = 0
        messages.append({"role": "assistant", "content": " ".join(u.reply for u in uses)})


def tool_conversation(rng: random.Random, mode: str | None = None) -> Conversation:
    """1-3 tools (the ones needed and others), a request that needs one or two calls, the calls
    (DeepSeek-V3's format; or the JSON array that tool_choice "required" constrains the output
    to, or a named function's arguments: after the forced `[` / `{`), sometimes the results
    and a short answer; sometimes an earlier round, or a question that needs no tool. `mode`
    ("auto", "required", "named", "none") fixes which; None draws it."""
    kinds = rng.sample(range(len(TOOL_KINDS)), rng.choice((1, 1, 2, 2, 3)))
    choices = [ToolChoice(rng, TOOL_KINDS[k]) for k in kinds]
    messages = [{"role": "system", "content": rng.choice(TOOL_SYSTEMS)}] \
        if rng.random() < 0.3 else []
    targets: dict[int, int] = {}
    if mode is None:
        mode = rng.choices(("auto", "required", "named", "none"), (0.62, 0.18, 0.1, 0.1))[0]
    if mode == "none" and not set(kinds) & ARITHMETIC_TOOLS:
        problem = plain_problem(rng)  # no tool fits: a plain answer
        messages.append({"role": "user", "content": problem.question})
        targets[len(messages)] = 0
        messages.append({"role": "assistant", "content": problem.answer})
        return Conversation(messages, [c.tool for c in choices], targets)
    mode = "auto" if mode == "none" else mode
    if mode == "auto" and rng.random() < 0.15:  # an earlier round, answered
        tool_round(rng, choices, messages, targets, "auto", True)
    tool_round(rng, choices, messages, targets, mode, mode == "auto" and rng.random() < 0.45)
    return Conversation(messages, [c.tool for c in choices], targets)
