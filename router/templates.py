"""Phrasings and topic lists that turn corpus text into request-shaped training examples.

Placeholders: {code} a snippet, {task} a programming task, {lang} a language, {err} an error line,
{text} a prose passage, {topic} a general topic, {a}/{b} two things to compare, {lang_h} a human
language, {thing} a writing subject, {person} someone to write to.
"""

LANGS = (
    "Python", "python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C++", "C", "C#", "Ruby",
    "PHP", "Kotlin", "Swift", "SQL", "bash", "shell", "R", "Scala", "Haskell", "Lua", "Perl",
)

TASKS = (
    "reverse a linked list", "parse a JSON file", "read a CSV file into a list of dicts",
    "sort a dictionary by value", "remove duplicates from a list while keeping order",
    "check if a string is a palindrome", "find the longest common prefix of a list of strings",
    "implement binary search", "merge two sorted arrays", "flatten a nested list",
    "count word frequencies in a text file", "connect to a PostgreSQL database",
    "make an HTTP GET request with a timeout", "retry a function call with exponential backoff",
    "write a decorator that caches results", "run shell commands and capture the output",
    "walk a directory tree and list all .txt files", "convert a timestamp to a datetime in UTC",
    "validate an email address with a regex", "implement an LRU cache",
    "detect a cycle in a directed graph", "compute the Fibonacci numbers iteratively",
    "check whether a number is prime", "transpose a matrix", "debounce a function",
    "read environment variables with defaults", "serialize a dataclass to JSON",
    "parse command line arguments", "zip two lists into a dictionary", "chunk a list into batches",
    "implement a thread-safe queue", "download a file in chunks", "hash a password securely",
    "compare two files line by line", "implement quicksort", "implement a trie",
    "find the k largest elements", "group records by a key", "write a unit test with mocks",
    "handle SIGTERM gracefully", "limit concurrency of async tasks", "stream a large file lazily",
    "deep copy a nested object", "convert snake_case to camelCase", "pretty print a JSON string",
    "use a context manager to time a block", "join two tables on a key", "paginate query results",
    "create a REST endpoint", "write a generator that yields primes", "escape HTML in a string",
    "format a number with thousands separators", "memoize a recursive function",
    "profile a slow function", "read a file line by line", "create a virtual environment",
    "set up logging to a file", "parse XML", "compress a folder into a zip file",
    "calculate the median of a list", "rotate an array by k positions", "find anagrams in a list",
    "implement Dijkstra's algorithm", "build a min heap", "swap two variables",
    "schedule a job every 5 minutes", "mock datetime.now in a test", "batch insert rows",
    "upload a file to S3", "handle a KeyError when reading a dict", "split a string on whitespace",
)

CODE_WITH_SNIPPET = (
    "What does this code do?\n\n{code}",
    "Can you explain this function?\n{code}",
    "explain this:\n{code}",
    "Why does this raise an exception?\n\n{code}\n\n{err}",
    "I get this error:\n{err}\n\nwhen running:\n{code}",
    "Fix the bug in this code:\n{code}",
    "fix this pls\n{code}",
    "Refactor this to be more readable:\n\n{code}",
    "Add type hints and a docstring to this function.\n{code}",
    "Write unit tests for the following code using pytest:\n{code}",
    "Can you optimize this? It's too slow on big inputs.\n{code}",
    "Convert this {lang} code to {lang2}:\n{code}",
    "Review this code and point out problems:\n\n{code}",
    "{code}\n\nwhat's wrong with this?",
    "{code}\n\nHow can I make this faster?",
    "is there a cleaner way to write this?\n{code}",
    "Complete the following function:\n\n{code}",
    "Add error handling to this:\n{code}",
    "hey so this keeps failing with {err}, any idea?\n{code}",
    "Rewrite this using a list comprehension:\n{code}",
    "Translate this into idiomatic {lang2}.\n{code}",
    "Document this code.\n{code}",
    "Why is my output wrong?\n{code}\nExpected a list but got None.",
)

CODE_NO_SNIPPET = (
    "How do I {task} in {lang}?",
    "how to {task} in {lang}",
    "Write a {lang} function to {task}.",
    "write a function that {doc}",
    "Write a {lang} script to {task}.",
    "Can you show me how to {task} using {lang}?",
    "What's the most efficient way to {task} in {lang}?",
    "Implement a function that {doc} in {lang}.",
    "{lang}: {task}?",
    "quick question - how would I {task} in {lang}",
    "I need code to {task}. Use {lang}.",
    "hey, do you know how to {task} with {lang}? been stuck for an hour lol",
    "Give me an example of how to {task} in {lang}, with comments.",
    "What is the time complexity of code that {doc}?",
    "Write a class in {lang} that {doc}.",
    "Explain how to {task} in {lang} step by step, with code.",
    "My {lang} program crashes with {err}. How do I fix it?",
    "Getting {err} in my {lang} code, what does it mean?",
    "what does `{name}` do in {lang}?",
    "What's the difference between `{name}` and `{name2}`?",
    "How do I use {name} correctly?",
    "Write a SQL query to {sql}.",
    "sql query to {sql}",
    "Write a regex that matches {regex}.",
    "How do I {git} with git?",
    "{err}",
    "Traceback (most recent call last):\n  File \"{file}\", line {line}, in {name}\n{err}",
)

SQL_TASKS = (
    "find the top 5 customers by total order value", "count orders per day for the last month",
    "delete duplicate rows keeping the newest", "join users and orders and show users with no orders",
    "get the second highest salary", "compute a running total per account",
    "find employees who earn more than their manager", "list products that were never sold",
)

REGEX_TASKS = (
    "US phone numbers", "IPv4 addresses", "dates like 2024-01-31", "hex color codes",
    "words that start with a capital letter", "email addresses", "URLs with query strings",
)

GIT_TASKS = (
    "undo the last commit but keep the changes", "squash my last three commits",
    "rename a branch", "resolve a merge conflict", "revert a pushed commit",
    "cherry-pick a commit from another branch", "delete a remote branch",
)

ERRORS = (
    "TypeError: 'NoneType' object is not subscriptable", "KeyError: 'id'",
    "IndexError: list index out of range", "AttributeError: 'str' object has no attribute 'append'",
    "ValueError: invalid literal for int() with base 10: 'abc'",
    "ModuleNotFoundError: No module named 'requests'", "RecursionError: maximum recursion depth exceeded",
    "UnboundLocalError: local variable 'total' referenced before assignment",
    "ZeroDivisionError: division by zero", "SyntaxError: invalid syntax",
    "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
    "Uncaught TypeError: Cannot read properties of undefined (reading 'map')",
    "segmentation fault (core dumped)", "NullPointerException",
    "error[E0382]: borrow of moved value: `v`", "panic: runtime error: index out of range [3] with length 3",
    "undefined reference to `main'", "FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'",
    "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)",
    "ImportError: cannot import name 'x' from partially initialized module",
)

# Short snippets in other languages; {name} and {name2} come from stdlib identifiers.
OTHER_LANG_SNIPPETS = (
    ("JavaScript", "function {name}(items) {{\n  return items.filter(x => x.{name2} !== undefined).map(x => x.{name2});\n}}"),
    ("JavaScript", "const {name} = async (url) => {{\n  const res = await fetch(url);\n  if (!res.ok) throw new Error(res.status);\n  return res.json();\n}};"),
    ("TypeScript", "interface {Name} {{\n  id: number;\n  {name2}: string;\n}}\n\nexport function {name}(x: {Name}[]): string[] {{\n  return x.map(v => v.{name2});\n}}"),
    ("Go", "func {Name}(xs []int) int {{\n\ttotal := 0\n\tfor _, x := range xs {{\n\t\ttotal += x\n\t}}\n\treturn total\n}}"),
    ("Rust", "fn {name}(v: &Vec<i32>) -> i32 {{\n    v.iter().map(|x| x * 2).sum()\n}}"),
    ("Java", "public static int {name}(int[] arr) {{\n    int best = arr[0];\n    for (int i = 1; i < arr.length; i++) {{\n        if (arr[i] > best) best = arr[i];\n    }}\n    return best;\n}}"),
    ("C", "#include <stdio.h>\n\nint {name}(int n) {{\n    if (n < 2) return n;\n    return {name}(n - 1) + {name}(n - 2);\n}}"),
    ("C++", "std::vector<int> {name}(const std::vector<int>& v) {{\n    std::vector<int> out(v);\n    std::sort(out.begin(), out.end());\n    return out;\n}}"),
    ("SQL", "SELECT u.{name}, COUNT(o.id) AS orders\nFROM users u\nLEFT JOIN orders o ON o.user_id = u.id\nGROUP BY u.{name}\nHAVING COUNT(o.id) > 3;"),
    ("bash", "#!/bin/bash\nfor f in *.log; do\n  gzip \"$f\" && echo \"compressed $f\"\ndone"),
    ("Ruby", "def {name}(items)\n  items.select {{ |x| x.{name2}? }}.map(&:to_s)\nend"),
    ("PHP", "<?php\nfunction {name}($items) {{\n    return array_map(fn($x) => $x['{name2}'], $items);\n}}"),
    ("Kotlin", "fun {name}(xs: List<Int>): Int = xs.filter {{ it > 0 }}.sum()"),
    ("C#", "public IEnumerable<string> {Name}(IEnumerable<User> users) =>\n    users.Where(u => u.IsActive).Select(u => u.{Name2});"),
    ("JavaScript", "document.querySelector('#{name}').addEventListener('click', () => {{\n  setCount(count + 1);\n}});"),
    ("Python", "import pandas as pd\n\ndf = pd.read_csv('{name}.csv')\ndf['{name2}'] = df['{name2}'].fillna(0)\nprint(df.groupby('{name}').sum())"),
)

GENERAL_WITH_TEXT = (
    "Summarize the following text:\n\n{text}",
    "Summarize this in two sentences: {text}",
    "tl;dr:\n{text}",
    "Give me the key points of this passage.\n\n{text}",
    "Translate into {lang_h}:\n{text}",
    "translate to {lang_h}: {text}",
    "Rewrite this paragraph in plain English for a beginner:\n{text}",
    "Make this more concise:\n\n{text}",
    "Proofread the following and fix grammar mistakes:\n{text}",
    "Paraphrase this:\n{text}",
    "Explain this passage like I'm five:\n\n{text}",
    "What is the main idea of this text?\n{text}",
    "Turn this into a bulleted list:\n{text}",
    "Write three quiz questions based on this text:\n{text}",
    "{text}\n\nSummarize the above.",
    "{text}\n\nCan you rewrite this in a more formal tone?",
    "Please shorten this paragraph: {text}",
    "Write a title for this article:\n{text}",
    "Rewrite the following for a press release:\n{text}",
)

GENERAL_NO_TEXT = (
    "Explain {topic}.", "explain {topic} in simple terms", "What is {topic}?", "what is {topic}",
    "Can you explain {topic} to a high school student?", "Give me a short overview of {topic}.",
    "How does {topic} work?", "Write an essay about {topic}.", "Write a 500-word article on {topic}.",
    "Write a blog post about {topic}.", "What are the pros and cons of {topic}?",
    "Summarize the history of {topic}.", "List five interesting facts about {topic}.",
    "Compare {a} and {b}.", "What's the difference between {a} and {b}?", "{a} vs {b}: which is better?",
    "Write a poem about {thing}.", "write a haiku about {thing}", "Write a short story about {thing}.",
    "Write a limerick about {thing}.", "Write a song about {thing}.",
    "Write an email to my {person} about {matter}.", "Draft a polite email to my {person} asking about {matter}.",
    "Write a cover letter for a {job} position.", "Write a product description for {product}.",
    "Give me tips for {activity}.", "How can I get better at {activity}?",
    "What should I know before {activity}?", "Create a study plan for learning {subject}.",
    "Outline a presentation on {topic}.", "Translate '{phrase}' into {lang_h}.",
    "How do you say '{phrase}' in {lang_h}?", "What are the main causes of {event}?",
    "Describe the impact of {event}.", "Who was {figure} and why are they important?",
    "Give me a recipe for {dish}.", "Plan a 3-day trip to {place}.", "What is the capital of {country}?",
    "Define {word}.", "What does the word '{word}' mean?", "Suggest a name for {product}.",
    "Write a tweet announcing {matter}.", "Brainstorm ideas for {matter}.",
    "Create a workout plan for {activity}.", "Explain the theory behind {topic} with an example.",
    "Argue for and against {topic}.", "What are the ethical issues around {topic}?",
    "Rewrite this sentence to sound more professional: '{phrase}'",
)

HUMAN_LANGS = ("French", "Spanish", "German", "Italian", "Japanese", "Chinese", "Portuguese", "Korean", "Russian", "Dutch", "Arabic", "Hindi")

TOPICS = (
    "photosynthesis", "the theory of relativity", "inflation", "climate change", "the French Revolution",
    "supply and demand", "the water cycle", "black holes", "machine learning", "the immune system",
    "compound interest", "the Renaissance", "plate tectonics", "the stock market", "quantum entanglement",
    "democracy", "the Industrial Revolution", "natural selection", "vaccines", "the Roman Empire",
    "renewable energy", "the causes of World War I", "the Cold War", "DNA replication", "blockchain",
    "the greenhouse effect", "cognitive behavioral therapy", "the electoral college", "meditation",
    "the Big Bang", "game theory", "the placebo effect", "cryptocurrency", "universal basic income",
    "the circulatory system", "the printing press", "impressionism", "stoicism", "existentialism",
    "the scientific method", "opportunity cost", "the ozone layer", "nuclear fusion", "the silk road",
    "globalization", "minimalism", "remote work", "social media's effect on teenagers",
    "the history of jazz", "the Great Depression", "artificial intelligence in healthcare",
    "electric cars", "the human brain", "sleep", "nutrition", "the moon landing", "volcanoes",
    "the American Civil War", "Shakespeare's Hamlet", "the Mona Lisa", "the Olympic Games",
    "interest rates", "the gig economy", "urbanization", "biodiversity", "antibiotic resistance",
    "the speed of light", "tides", "earthquakes", "the Magna Carta", "the Enlightenment",
    "behavioral economics", "the Pythagorean theorem", "probability", "calculus", "entropy",
    "the solar system", "evolution", "leadership", "time management", "public speaking",
    "emotional intelligence", "the Fed", "recessions", "the Internet", "5G networks", "privacy",
)

PAIRS = (
    ("capitalism", "socialism"), ("cats", "dogs"), ("tea", "coffee"), ("renting", "buying a house"),
    ("stocks", "bonds"), ("weather", "climate"), ("a virus", "a bacterium"), ("Plato", "Aristotle"),
    ("baroque", "classical music"), ("mitosis", "meiosis"), ("weight", "mass"), ("an LLC", "a corporation"),
    ("solar", "wind power"), ("the iPhone", "Android phones"), ("running", "swimming"),
    ("affect", "effect"), ("empathy", "sympathy"), ("Roth IRA", "traditional IRA"),
)

THINGS = (
    "the ocean", "autumn leaves", "a rainy morning", "friendship", "a lost cat", "the city at night",
    "growing old", "a dragon who is afraid of fire", "coffee", "the first day of school", "mountains",
    "a robot learning to paint", "summer vacation", "my grandmother's kitchen", "the stars", "winter",
)

PEOPLE = ("boss", "landlord", "professor", "team", "client", "neighbor", "doctor", "HR department", "coworker")

MATTERS = (
    "a deadline extension", "a broken heater", "the quarterly results", "a refund", "a meeting next week",
    "our product launch", "a charity bake sale", "a scheduling conflict", "my vacation request",
    "a new recycling program", "the office move",
)

JOBS = ("marketing manager", "nurse", "data analyst", "teacher", "sales", "project manager", "barista")
PRODUCTS = ("a reusable water bottle", "noise-cancelling headphones", "a standing desk", "a vegan bakery", "a hiking app")
ACTIVITIES = ("running a marathon", "public speaking", "saving money", "learning a language", "studying for exams", "traveling to Japan", "gardening", "negotiating a salary", "chess")
SUBJECTS = ("organic chemistry", "Spanish", "statistics", "world history", "music theory", "economics")
EVENTS = ("the French Revolution", "the 2008 financial crisis", "World War II", "the fall of Rome", "the Black Death", "the Industrial Revolution")
FIGURES = ("Marie Curie", "Napoleon", "Nelson Mandela", "Leonardo da Vinci", "Ada Lovelace", "Gandhi", "Cleopatra", "Isaac Newton")
DISHES = ("lasagna", "pad thai", "banana bread", "chicken curry", "a vegan chili", "pancakes", "guacamole")
PLACES = ("Rome", "Kyoto", "Lisbon", "New York", "Iceland", "Barcelona", "the Grand Canyon")
COUNTRIES = ("Australia", "Canada", "Brazil", "Kenya", "Mongolia", "Peru", "Norway")
WORDS = ("serendipity", "ubiquitous", "ephemeral", "pragmatic", "hegemony", "paradigm", "nostalgia")
PHRASES = (
    "good morning", "where is the train station", "thank you very much", "I would like a coffee",
    "we need to talk about the budget", "the meeting has been moved to Friday",
)

SYSTEM_PROMPTS = (
    "You are a helpful assistant.", "You are a helpful assistant.", "You are ChatGPT, a large language model.",
    "You are a friendly, casual conversation partner.", "You are an expert software engineer.",
    "Answer concisely.", "You are a knowledgeable tutor.", "",
)

DIALOG_OPENERS = (
    "hi", "hello", "hey", "hey there!", "Hi!", "good morning", "Good evening :)", "yo", "sup",
    "hey how are you?", "how's it going", "what's up?", "hiya", "Hello, how are you today?",
    "thanks!", "thank you so much", "lol", "haha nice", "ok cool", "bye!", "see you later",
    "good night", "nice to meet you", "how was your day?", "what are you up to?",
    "I'm bored, talk to me", "tell me about yourself", "do you have any hobbies?",
    "what's your favorite movie?", "I had a really rough day at work", "I just got a puppy!!",
    "guess what happened today", "are you a real person?", "can we just chat for a bit?",
    "I can't sleep", "what did you do this weekend?", "I'm so excited for the holidays",
    "ugh mondays", "do you like music?", "I feel kind of lonely today", "you're funny",
)

ASSISTANT_CODE_REPLIES = (
    "Sure! Here's one way to do it:\n\n```python\n{code}\n```",
    "The problem is on this line. Try this instead:\n```\n{code}\n```",
    "You can do it like this:\n{code}",
)

# Conceptual programming questions (no code in the request): the hardest code requests to tell
# apart from general "explain X" requests.
CONCEPTS = (
    "a Python decorator", "closures", "generators", "async/await", "the virtual DOM", "pointers",
    "garbage collection", "dependency injection", "a race condition", "a mutex", "recursion",
    "memoization", "the event loop", "a hash map", "a linked list", "big O notation",
    "polymorphism", "inheritance vs composition", "a REST API", "GraphQL", "a Docker container",
    "a Kubernetes pod", "CORS", "a memory leak", "SQL injection", "an index in a database",
    "ORM", "unit testing", "continuous integration", "type hints", "the GIL", "list comprehensions",
    "lambda functions", "a monad", "tail recursion", "dynamic programming", "a deadlock",
    "microservices", "webpack", "React hooks", "JWT authentication", "a segfault", "move semantics in C++",
    "Rust's borrow checker", "Go channels", "TCP vs UDP sockets", "a cache invalidation bug",
    "virtual environments", "semantic versioning", "a git rebase", "regular expressions",
)

TECHS = (
    "react component", "docker container", "kubernetes pod", "flask app", "django view", "node server",
    "postgres query", "python script", "webpack build", "npm install", "pip install", "nginx config",
    "jupyter notebook", "spring boot app", "unity game", "github actions workflow", "terraform plan",
    "pytest suite", "celery worker", "redis cache", "next.js page", "android app", "swift ui view",
)

SYMPTOMS = (
    "keeps crashing on startup", "re-renders twice", "exits immediately", "is really slow",
    "hangs forever", "returns a 500 error", "uses too much memory", "times out after 30 seconds",
    "can't find the module", "fails only in CI", "works locally but not in production",
    "gives a permission denied error", "leaks connections", "shows a blank page",
)

CODE_CONCEPT_Q = (
    "Explain {concept}.", "explain {concept} with an example", "What is {concept}?",
    "what is {concept} and when should I use it", "Can you explain {concept} in simple terms?",
    "What's the difference between {concept} and {concept2}?", "When should I use {concept}?",
    "why does my {tech} {symptom}?", "my {tech} {symptom}, any idea why?",
    "My {tech} {symptom}. How do I debug it?", "how do I fix a {tech} that {symptom}",
    "What is the time complexity of {op}?", "what's the big O of {op}",
    "Is {concept} a good idea for a {tech}?", "best practices for {concept}?",
    "How does {concept} work under the hood?", "what does `{module}.{name}` do?",
    "How do I use the {module} module?", "Is {lang} {property}?", "does {lang} have {feature}?", "Explain the {module} module with examples.",
)

OPERATIONS = (
    "inserting into a python dict", "sorting a list", "appending to an array list",
    "looking up a key in a hash map", "binary search", "deleting from a linked list",
    "heap push", "string concatenation in a loop", "set membership tests",
)

# Short factual questions and everyday writing requests: general, though they read like chat.
FACT_Q = (
    "What year did {event} end?", "When did {event} start?", "what year was {invention} invented",
    "Who invented {invention}?", "Who wrote {book}?", "What's the population of {place}?",
    "how tall is {landmark}", "Where is {landmark}?", "How many {part} are in {whole}?",
    "What is the largest {category} in the world?", "How far is {place} from {place2}?",
    "Recommend some good books on {subject}.", "can you recommend a few books about {topic}?",
    "Suggest some movies like {movie}.", "What are some good podcasts about {subject}?",
    "Write a {occasion} toast for my {relation}.", "Write a {occasion} card message for my {relation}.",
    "Write a speech for my {relation}'s {occasion}.", "What's the tallest mountain in {country}?",
    "Which country has the most {category}?", "What language do they speak in {country}?",
    "Name three famous works by {figure}.", "Why is the sky blue?", "How long does it take to {activity}?",
    "What is the boiling point of water in Fahrenheit?", "How many people live in {country}?",
)
INVENTIONS = ("the telephone", "the light bulb", "the printing press", "penicillin", "the airplane", "the internet", "the steam engine")
BOOKS = ("Pride and Prejudice", "1984", "War and Peace", "The Great Gatsby", "Don Quixote", "The Odyssey", "Moby-Dick")
LANDMARKS = ("the Eiffel Tower", "Mount Everest", "the Statue of Liberty", "Machu Picchu", "the Great Wall of China", "Big Ben")
PARTS = (("bones", "the human body"), ("cups", "a gallon"), ("players", "a soccer team"), ("keys", "a piano"), ("days", "a leap year"))
CATEGORIES = ("desert", "ocean", "island", "lake", "volcanoes", "time zones", "languages", "rivers")
MOVIES = ("Inception", "The Godfather", "Amelie", "Spirited Away", "Jurassic Park")
OCCASIONS = ("wedding", "birthday", "retirement", "graduation", "farewell", "anniversary")
RELATIONS = ("best friend", "sister", "brother", "colleague", "parents", "grandfather", "mentor")
PROPERTIES = ("pass by reference or by value", "statically typed", "compiled or interpreted", "garbage collected", "thread safe by default", "good for web development")
FEATURES = ("generics", "pattern matching", "tail call optimization", "null safety", "operator overloading", "a package manager")
