"""Five-field cron expressions in UTC: ``minute hour day-of-month month day-of-week``.

Fields take ``*``, numbers, ranges ``a-b``, steps ``*/n`` and ``a-b/n``, lists
``a,b``, month and weekday names (``jan``, ``mon``), ``7`` for Sunday, and the
macros ``@hourly``, ``@daily``/``@midnight``, ``@weekly``, ``@monthly``,
``@yearly``/``@annually``. As in Vixie cron, when both day fields are
restricted a day matches if either does.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_abbr) if name}
WEEKDAYS = {"sun": 0, "mon": 1, "tue": 2, "wed": 3, "thu": 4, "fri": 5, "sat": 6}
MACROS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}
FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, MONTHS),
    ("day of week", 0, 7, WEEKDAYS),
)
# Every valid expression fires within this many days (29 February recurs within 8 years).
SEARCH_DAYS = 366 * 8 + 2


class CronError(ValueError):
    """The expression is not a valid cron expression; the message says which part."""


@dataclass(frozen=True)
class Cron:
    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    days_restricted: bool
    weekdays_restricted: bool

    def _day_matches(self, day: datetime) -> bool:
        if day.month not in self.months:
            return False
        in_month = day.day in self.days
        # isoweekday: Monday 1 … Sunday 7; cron: Sunday 0.
        in_week = day.isoweekday() % 7 in self.weekdays
        if self.days_restricted and self.weekdays_restricted:
            return in_month or in_week
        return in_month and in_week

    def next_after(self, moment: datetime) -> datetime:
        """The first firing time strictly after ``moment`` (UTC, whole minutes)."""
        start = moment.astimezone(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
        day = start.replace(hour=0, minute=0)
        for _ in range(SEARCH_DAYS):
            if self._day_matches(day):
                for hour in sorted(self.hours):
                    for minute in sorted(self.minutes):
                        candidate = day.replace(hour=hour, minute=minute)
                        if candidate >= start:
                            return candidate
            day += timedelta(days=1)
        raise CronError(f"{self.expression!r} never fires")


def _value(text: str, low: int, high: int, names: dict[str, int], field: str) -> int:
    lowered = text.lower()
    if lowered in names:
        return names[lowered]
    if not text.isdigit():
        raise CronError(f"{field}: {text!r} is not a number" + (" or a name" if names else ""))
    value = int(text)
    if not low <= value <= high:
        raise CronError(f"{field}: {value} is outside {low}-{high}")
    return value


def _field(text: str, low: int, high: int, names: dict[str, int], field: str) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        if not part:
            raise CronError(f"{field}: empty list item in {text!r}")
        base, _, step_text = part.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) == 0:
                raise CronError(f"{field}: step {step_text!r} must be a positive number")
            step = int(step_text)
        if base == "*":
            first, last = low, high
        elif "-" in base:
            a, _, b = base.partition("-")
            first, last = _value(a, low, high, names, field), _value(b, low, high, names, field)
            if first > last:
                raise CronError(f"{field}: range {base!r} runs backwards")
        else:
            first = _value(base, low, high, names, field)
            last = high if step_text else first
        values.update(range(first, last + 1, step))
    return frozenset(values)


def parse(expression: str) -> Cron:
    text = " ".join(expression.split())
    text = MACROS.get(text.lower(), text)
    parts = text.split(" ")
    if len(parts) != 5:
        raise CronError(f"expected 5 fields (minute hour day-of-month month day-of-week), got {len(parts)}")
    parsed = [
        _field(part, low, high, names, name)
        for part, (name, low, high, names) in zip(parts, FIELDS, strict=True)
    ]
    weekdays = frozenset(d % 7 for d in parsed[4])
    cron = Cron(
        expression=expression.strip(),
        minutes=parsed[0],
        hours=parsed[1],
        days=parsed[2],
        months=parsed[3],
        weekdays=weekdays,
        days_restricted=not parts[2].startswith("*"),
        weekdays_restricted=not parts[4].startswith("*"),
    )
    # "0 0 30 2 *" parses but never fires: refuse it now, not at the first run.
    cron.next_after(datetime(2000, 1, 1, tzinfo=UTC))
    return cron
