"""The structured-output workload of benchmarks/structured_outputs.py: 20 extraction tasks (a short text and the JSON
schema its facts go into: nested objects, arrays, enums, numbers with bounds) and a tool-calling set (a request and
the tools to pick from)."""

from __future__ import annotations

S = {"type": "string", "maxLength": 60}
INT = {"type": "integer"}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def arr(items: dict, lo: int = 1, hi: int = 6) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def enum(*values: str) -> dict:
    return {"enum": list(values)}


def num(lo: float, hi: float, integer: bool = False) -> dict:
    return {"type": "integer" if integer else "number", "minimum": lo, "maximum": hi}


EXTRACTION: list[tuple[str, dict]] = [
    (
        "Maria Lopez, 34, is a senior data engineer at Northwind Labs in Madrid. She joined in 2019.",
        obj(
            {
                "name": S,
                "age": num(0, 120, True),
                "job": obj({"title": S, "level": enum("junior", "mid", "senior", "lead"), "company": S}),
                "city": S,
                "start_year": num(1950, 2030, True),
            }
        ),
    ),
    (
        "Order #A-2291: 3 USB-C cables at $9.99 each and 1 laptop stand at $34.50, shipped express to Berlin.",
        obj(
            {
                "order_id": S,
                "items": arr(obj({"product": S, "quantity": num(1, 100, True), "unit_price": num(0, 10000)})),
                "shipping": enum("standard", "express", "overnight"),
                "destination": S,
            }
        ),
    ),
    (
        "The meeting with the design team is on 2026-03-14 at 15:30 in room B12; Ana, Ben and Chloe will attend.",
        obj(
            {
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
                "room": S,
                "attendees": arr(S, 1, 10),
            }
        ),
    ),
    (
        "Review: The espresso machine heats up fast and the milk frother is great, but the water tank leaks. 3/5.",
        obj(
            {
                "product": S,
                "sentiment": enum("positive", "mixed", "negative"),
                "pros": arr(S, 0, 5),
                "cons": arr(S, 0, 5),
                "rating": num(1, 5, True),
            }
        ),
    ),
    (
        "Flight LH404 from Frankfurt (FRA) to New York (JFK) departs at 10:05 and is delayed by 45 minutes.",
        obj(
            {
                "flight": S,
                "origin": obj({"city": S, "iata": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
                "destination": obj({"city": S, "iata": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
                "status": enum("on_time", "delayed", "cancelled"),
                "delay_minutes": num(0, 1440, True),
            }
        ),
    ),
    (
        "Patient, 58, male, reports chest pain for two days; blood pressure 150/95; allergic to penicillin.",
        obj(
            {
                "age": num(0, 120, True),
                "sex": enum("male", "female", "other"),
                "symptoms": arr(obj({"name": S, "duration_days": num(0, 365, True)})),
                "blood_pressure": obj({"systolic": num(50, 250, True), "diastolic": num(30, 150, True)}),
                "allergies": arr(S, 0, 5),
            }
        ),
    ),
    (
        "Acme Corp reported Q3 revenue of 12.4 million dollars, up 8 percent, with 230 employees.",
        obj(
            {
                "company": S,
                "quarter": enum("Q1", "Q2", "Q3", "Q4"),
                "revenue_millions": num(0, 1000000),
                "growth_percent": num(-100, 1000),
                "employees": num(0, 10000000, True),
            }
        ),
    ),
    (
        "Recipe: pancakes for 4. Mix 200 g flour, 2 eggs and 300 ml milk; cook 2 minutes per side.",
        obj(
            {
                "dish": S,
                "servings": num(1, 50, True),
                "ingredients": arr(
                    obj({"name": S, "amount": num(0, 10000), "unit": enum("g", "ml", "piece")})
                ),
                "cook_minutes": num(0, 600, True),
            }
        ),
    ),
    (
        "Bug report: the app crashes on Android 14 when uploading a photo larger than 20 MB. Severity high.",
        obj(
            {
                "title": S,
                "platform": enum("android", "ios", "web", "desktop"),
                "os_version": S,
                "severity": enum("low", "medium", "high", "critical"),
                "steps": arr(S, 1, 5),
            }
        ),
    ),
    (
        "The apartment on 12 Rue Cler, Paris, has 3 rooms, 68 square meters, rent 2100 euros, available in May.",
        obj(
            {
                "address": obj({"street": S, "city": S}),
                "rooms": num(1, 20, True),
                "area_m2": num(5, 1000),
                "rent": obj({"amount": num(0, 100000), "currency": enum("EUR", "USD", "GBP")}),
                "available_month": enum(
                    "January",
                    "February",
                    "March",
                    "April",
                    "May",
                    "June",
                    "July",
                    "August",
                    "September",
                    "October",
                    "November",
                    "December",
                ),
            }
        ),
    ),
    (
        "Job posting: remote Python developer, 3+ years, skills Django, PostgreSQL and Docker, salary 70-90k USD.",
        obj(
            {
                "role": S,
                "remote": {"type": "boolean"},
                "min_years": num(0, 40, True),
                "skills": arr(S, 1, 8),
                "salary": obj({"min": num(0, 1000000, True), "max": num(0, 1000000, True), "currency": S}),
            }
        ),
    ),
    (
        "Weather: Oslo tomorrow, snow showers, high of -2 C and low of -7 C, wind 30 km/h from the north.",
        obj(
            {
                "city": S,
                "condition": enum("sunny", "cloudy", "rain", "snow", "storm"),
                "high_c": num(-80, 60),
                "low_c": num(-80, 60),
                "wind": obj({"kmh": num(0, 400), "direction": enum("north", "east", "south", "west")}),
            }
        ),
    ),
    (
        "Invoice 2026-117 from Blue Print Ltd to Harbor Cafe: 500 flyers (120.00) and 2 posters (45.00), VAT 20%.",
        obj(
            {
                "invoice_number": S,
                "seller": S,
                "buyer": S,
                "lines": arr(obj({"description": S, "total": num(0, 1000000)})),
                "vat_percent": num(0, 100),
            }
        ),
    ),
    (
        "Book: 'The Silent Orbit' by J. Okafor, science fiction, 412 pages, published 2021, rated 4.3 of 5.",
        obj(
            {
                "title": S,
                "author": S,
                "genre": enum("fiction", "science fiction", "fantasy", "mystery", "non-fiction"),
                "pages": num(1, 5000, True),
                "year": num(1400, 2030, True),
                "rating": num(0, 5),
            }
        ),
    ),
    (
        "Server alert: disk usage on db-03 reached 91 percent at 04:12 UTC; the backup job failed twice.",
        obj(
            {
                "host": S,
                "metric": enum("cpu", "memory", "disk", "network"),
                "value_percent": num(0, 100),
                "time_utc": S,
                "related_failures": arr(obj({"job": S, "count": num(1, 100, True)}), 0, 5),
            }
        ),
    ),
    (
        "Contact: Dr. Wei Zhang, phone +44 20 7946 0958, email wei.zhang@example.org, prefers email.",
        obj(
            {
                "title": enum("Mr.", "Ms.", "Dr.", "Prof."),
                "name": S,
                "phone": S,
                "email": S,
                "preferred_channel": enum("phone", "email", "post"),
            }
        ),
    ),
    (
        "Match report: Lions beat Falcons 3-1; goals by Ito (12'), Silva (40', 77') for Lions and Moreau (58').",
        obj(
            {
                "home": obj({"team": S, "score": num(0, 50, True)}),
                "away": obj({"team": S, "score": num(0, 50, True)}),
                "goals": arr(obj({"player": S, "minute": num(1, 130, True)}), 0, 12),
            }
        ),
    ),
    (
        "The laptop has a 14-inch screen, 16 GB RAM, a 512 GB SSD, weighs 1.3 kg and costs 1299 dollars.",
        obj(
            {
                "screen_inches": num(7, 20),
                "ram_gb": enum("8", "16", "32", "64"),
                "storage": obj({"size_gb": num(64, 8192, True), "type": enum("SSD", "HDD")}),
                "weight_kg": num(0.3, 5),
                "price_usd": num(0, 20000),
            }
        ),
    ),
    (
        "Trip plan: day 1 Kyoto temples, day 2 Nara park, day 3 Osaka food tour; budget 900 dollars for 2 people.",
        obj(
            {
                "days": arr(obj({"day": num(1, 30, True), "city": S, "activity": S}), 1, 10),
                "budget_usd": num(0, 100000),
                "travellers": num(1, 20, True),
            }
        ),
    ),
    (
        "Classify this support ticket: 'I was charged twice for my March subscription, please refund one.'",
        obj(
            {
                "category": enum("billing", "technical", "account", "other"),
                "priority": enum("low", "normal", "urgent"),
                "refund_requested": {"type": "boolean"},
                "summary": S,
            }
        ),
    ),
]


def _tool(name: str, description: str, props: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": obj(props)},
    }


TOOLS = [
    _tool("get_weather", "Current weather for a city.", {"city": S, "unit": enum("celsius", "fahrenheit")}),
    _tool("convert_currency", "Convert an amount.", {"amount": num(0, 1e9), "from": S, "to": S}),
    _tool("search_flights", "Find flights.", {"origin": S, "destination": S, "date": S}),
    _tool(
        "create_event",
        "Add a calendar event.",
        {"title": S, "date": S, "duration_minutes": num(5, 600, True)},
    ),
]

TOOL_REQUESTS = [
    "What's the weather in Lisbon right now, in celsius?",
    "How much is 250 US dollars in euros?",
    "Find me a flight from Boston to Denver on 2026-05-02.",
    "Put a 30 minute 'Standup' meeting in my calendar on 2026-04-01.",
    "Is it raining in Seattle? Use fahrenheit.",
    "Convert 1200 yen to pounds.",
    "Any flights from Rome to Athens on June 3rd 2026?",
    "Schedule 'Dentist' on 2026-02-10 for 45 minutes.",
]
