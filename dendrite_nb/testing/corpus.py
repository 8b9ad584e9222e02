"""Training text for the locally built test tokenizers.

Hand-written on purpose: nothing can be downloaded, and a fixed string keeps the trained
vocabulary identical across machines. The mix of prose, digits, JSON, code and chat-ish
lines makes the BPE merges resemble a real model's enough that tokenization bugs (spaces,
newlines, punctuation, multi-byte characters) show up in tests.
"""

CORPUS = """\
Trees are slow machines for turning sunlight into wood. An oak in a field spends its first
decade mostly underground, pushing roots toward water before it commits to height. When it
finally rises, each ring in the trunk records a year: wide rings for wet summers, narrow ones
for drought. Foresters read those rings the way a librarian reads a catalogue, quickly and
with a quiet kind of respect. A beech keeps its dead leaves through the winter, rattling in
the wind, while a birch drops everything and stands pale and bare against the snow.

The forest floor is busy even when the canopy is still. Fungi thread through the soil and
link the roots of different trees, trading sugar for minerals. Some ecologists call this the
wood-wide web, although the metaphor is looser than the headlines suggest. What is certain is
that a fallen log becomes a nursery: moss, beetles, seedlings and salamanders all move in
within a few seasons, and after fifty years there is almost nothing left of the log itself.

Rivers begin as rumours. A spring seeps from a hillside, a stream gathers it, and the stream
meets another until the water has a name on a map. Near the source the current is fast and
cold; it carries gravel and cuts narrow channels. Downstream the river slows, widens and
begins to wander, leaving oxbow lakes behind when a meander is cut off. People have always
settled beside rivers because they offer water, food, transport and, less happily, floods.
The Nile, the Danube, the Mekong and the Mississippi each shaped the cities that grew on their
banks. A bridge is a small argument with a river, and the river usually wins in the end.

Good reasoning is mostly patience. First, state what you actually know. Second, separate
what you observed from what you assumed. Third, ask what would change your mind. If every
swan you have seen is white, you may guess that all swans are white, but one black swan is
enough to refute the guess. Deduction moves from general rules to particular cases; induction
moves the other way, and abduction guesses the best explanation for a surprising fact. None of
these is magic. Each is a habit, and habits improve with practice and honest feedback.

Consider a small puzzle: Alice is older than Bob, and Bob is older than Carol. Who is the
youngest? Carol, because "older than" is transitive. Now a harder one: if it rains, the
street is wet; the street is wet; did it rain? Not necessarily. A street cleaner may have
passed by. Confusing the direction of an implication is one of the oldest mistakes there is.

Cooking is chemistry you can eat. Heat a pan until a drop of water skitters across it, add
a spoon of oil, then the onions, and wait. Do not stir too often; browning needs contact.
After eight or nine minutes the onions turn golden and sweet. Add garlic for the last minute
only, since it burns quickly. A pinch of salt draws out moisture, a splash of vinegar brightens
a heavy sauce, and butter stirred in at the end makes it glossy. Bread needs flour, water,
salt and yeast, plus time: the dough should double in size, which takes about an hour in a
warm kitchen and much longer in a cold one. Taste as you go. Recipes are maps, not territory.

Recipe: lemon rice (serves 4)
- 300 g rice, rinsed 3 times
- 600 ml water or stock
- 2 lemons (zest + juice)
- 1/2 tsp salt; 30 g butter
Step 1: simmer for 12-15 minutes. Step 2: rest 5 min, lid on. Step 3: stir in zest & juice.

Numbers turn up everywhere: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024, 65536.
Pi is about 3.14159 and e is about 2.71828; the square root of 2 is roughly 1.41421.
The meeting moved from 09:30 to 14:45 on 2024-03-17, room B-12, floor #3.
Prices: $4.99, EUR 12.50, 7% off, total = (3 * 4.99) + 12.50 - 1.05 = 26.42
Phone: +1 (555) 010-2233. Version 2.13.0 fixed issue #4821; see section 3.2.1 for details.

{"name": "Ada", "age": 36, "tags": ["x", "y"], "active": true, "score": 98.5}
{"id": 17, "items": [{"sku": "A-100", "qty": 2}, {"sku": "B-7", "qty": null}]}
{"query": "rivers in Europe", "limit": 10, "filters": {"min_length_km": 500}}
[1, 2, 3, [4, 5], {"k": "v"}, "quoted \\"text\\" here", false]

def greet(name: str, times: int = 1) -> str:
    \"\"\"Return a friendly greeting.\"\"\"
    parts = []
    for i in range(times):
        parts.append(f"Hello, {name}! ({i + 1})")
    return "\\n".join(parts)

class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

if __name__ == "__main__":
    print(greet("world", times=2))

for (int i = 0; i < n; ++i) { total += values[i] * weights[i]; }
const sum = (a, b) => a + b; // arrow function
SELECT name, age FROM people WHERE age >= 18 ORDER BY name;
$ pip install --upgrade package && python -m pytest -q tests/

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: And how long is the Seine?
Assistant: The Seine is about 777 kilometres long. It flows through Paris to the English Channel.
User: Can you summarise that in one sentence?
Assistant: Sure - the Seine, roughly 777 km long, runs through Paris into the Channel.

Questions worth asking: Why? How do you know? What else could explain it? Is that always true?
Exclamations happen too! Wow... really?! Yes; absolutely: no doubt -- well, mostly.
Quotes 'single' and "double", brackets (round) [square] {curly} <angle>, and a slash / or \\.
Tabs\tseparate\tcolumns\tsometimes, and   extra   spaces   appear   in   messy   text.

Some words borrowed from other languages: café, naïve, façade, jalapeño, über, smörgåsbord.
A few characters from further away: 日本語, 中文, 한국어, Ελληνικά, русский, العربية.
Symbols and emoji show up in chat logs: ✓ → ← ★ ♥ € £ ¥ 🌳 🌊 🍳 🤔 😀 👍.

In the evening the river is quiet and the trees along the bank go dark one by one. Someone
on the bridge is cooking supper on a small stove, stirring a pot of lentils, and thinking
through a problem from work: step by step, checking each assumption, writing the numbers on
the back of an envelope. The answer, when it comes, is simpler than expected. It usually is.
"""
