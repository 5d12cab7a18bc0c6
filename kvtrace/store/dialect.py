"""Where kvtrace's SQL differs between DuckDB and ClickHouse: the one place.

The store's SQL (read API, derived tables, writer) is written once, in DuckDB's
spelling. ``to_clickhouse(sql, params)`` rewrites it for ClickHouse with sqlglot's
parser and ClickHouse generator, plus the rules below where ClickHouse means something
else by the same words. Each rule keeps the DuckDB answer:

- ``$name`` becomes ``{name:Type}`` (typed from the value; ClickHouse wants a type).
  ``None`` is the NULL literal (never user text), and ``LIMIT NULL`` drops the LIMIT.
- ``a // b`` is ``intDiv(a, b)`` (sqlglot's float division would lose nanoseconds).
- ``unnest(x)`` in a select list becomes ``ARRAY JOIN`` (several of them zip, as in
  DuckDB; two ``arrayJoin`` calls would multiply), a shorter list padded with NULL as in
  DuckDB (a capture's evictions: hashes, no block ids), not its element's default.
- A bound list's type is its elements' (``Nullable`` with a None among them); an empty
  one's ``Array(Nothing)``, which compares with any type.
- ``count``, ``len``, ``range``, ``row_number`` give Int64 (ClickHouse: UInt64), so the
  frames have DuckDB's types.
- ``median`` is exact (``quantileExactInclusive``; ClickHouse's is sampled).
- ``lag``/``lead`` see NULL past the edge (``toNullable``; ClickHouse gives 0).
- ``TRY_CAST`` is ``accurateCastOrNull``; ``duckdb_tables()`` is ``system.tables``;
- ``count(*) FILTER (WHERE c)`` is ``countIf(c)``; ``list_position`` is ``indexOf``
  (NULL when absent), ``list_contains`` a Bool ``has``;
  ``SEMI JOIN`` is ``LEFT SEMI JOIN``; ``range(N) AS t(r)`` in FROM is ``numbers(N)``;
  casts keep arrays non-Nullable (ClickHouse has no NULL array: NULL is ``[]``).

Every query runs with ``SETTINGS`` (``QUERY_SETTINGS``) that make ClickHouse answer
like SQL: NULL for unmatched outer-join columns and for aggregates over no rows, and
zipped ARRAY JOIN of unequal lists padded rather than refused.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

# ClickHouse settings every kvtrace query runs with (see the module docstring).
QUERY_SETTINGS: dict[str, int] = {
    "join_use_nulls": 1,
    "aggregate_functions_null_for_empty": 1,
    "enable_unaligned_array_join": 1,
    # a name is the column before it is an alias of the same SELECT, as in DuckDB
    # (ORDER BY, which DuckDB binds to the aliases first, is rewritten to match)
    "prefer_column_name_to_alias": 1,
    "enable_positional_arguments": 1,
}

_SCALAR_TYPES = {
    "VARCHAR": "String", "BIGINT": "Int64", "INTEGER": "Int32", "UBIGINT": "UInt64", "DOUBLE": "Float64",
    "BOOLEAN": "Bool", "JSON": "String", "TIMESTAMP_NS": "DateTime64(9)",
    # how sqlglot spells some of them back in DuckDB's dialect
    "TEXT": "String", "INT": "Int32", "INT64": "Int64", "UINT64": "UInt64", "FLOAT64": "Float64", "BOOL": "Bool",
}


def clickhouse_type(duck: str, nullable: bool = True) -> str:
    """The ClickHouse column type for a DuckDB type of the store's schema: scalars
    Nullable (unless ``nullable=False``), lists as non-Nullable ``Array`` (ClickHouse has
    no NULL array), maps as ``Map``, structs as named ``Tuple``s of Nullable fields."""
    duck = duck.strip()
    if duck.endswith("[]"):
        return f"Array({clickhouse_type(duck[:-2], nullable=False)})"
    upper = duck.upper()
    if upper.startswith("MAP("):
        k, v = _split_args(duck[4:-1])
        return f"Map({clickhouse_type(k, False)}, {clickhouse_type(v, False)})"
    if upper.startswith("STRUCT("):
        fields = []
        for part in _split_args(duck[7:-1]):
            name, _, typ = part.strip().partition(" ")
            fields.append(f"{name} {clickhouse_type(typ, nullable=not _is_container(typ))}")
        return f"Tuple({', '.join(fields)})"
    base = _SCALAR_TYPES[upper]
    return f"Nullable({base})" if nullable else base


def _is_container(duck: str) -> bool:
    d = duck.strip().upper()
    return d.endswith("[]") or d.startswith(("MAP(", "STRUCT("))


def _split_args(text: str) -> list[str]:
    """Top-level comma split (types nest parentheses)."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        depth += (ch == "(") - (ch == ")")
        cur.append(ch)
    out.append("".join(cur))
    return [p.strip() for p in out]


# --- parameters -------------------------------------------------------------------------
_INT64_MAX = (1 << 63) - 1


def param_type(value: Any) -> str:
    """The ClickHouse type a bound value is sent as."""
    if isinstance(value, bool):
        return "Bool"
    if isinstance(value, int):
        return "UInt64" if value > _INT64_MAX else "Int64"
    if isinstance(value, float):
        return "Float64"
    if isinstance(value, str):
        return "String"
    if isinstance(value, (list, tuple)):
        # an empty list has no element type (Int64 here made list_contains($roots, a String) fail)
        inner = next((param_type(v) for v in value if v is not None), "Nothing")
        return f"Array(Nullable({inner}))" if None in value else f"Array({inner})"
    raise TypeError(f"cannot bind {type(value).__name__} to ClickHouse SQL")


def _signature(params: Mapping[str, Any]) -> tuple[tuple[str, str | None], ...]:
    return tuple(sorted((k, None if v is None else param_type(v)) for k, v in params.items()))


def to_clickhouse(sql: str, params: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """(ClickHouse SQL, the parameters it binds) for DuckDB-spelled ``sql`` whose
    ``$name`` placeholders take ``params``. Translations are cached per SQL text and
    parameter types, so a dashboard's repeated queries are parsed once."""
    params = dict(params or {})
    text = _translate(sql, _signature(params))
    used = set(re.findall(r"\{(\w+):", text))
    return text, {k: v for k, v in params.items() if k in used and v is not None}


@functools.lru_cache(maxsize=1024)
def _translate(sql: str, signature: tuple[tuple[str, str | None], ...]) -> str:
    import sqlglot
    from sqlglot import exp

    types = dict(signature)
    tree = sqlglot.parse_one(sql, read="duckdb")
    # LIMIT $x with x None: no limit
    for limit in list(tree.find_all(exp.Limit)):
        target = limit.expression
        if isinstance(target, exp.Placeholder) and types.get(target.name, "") is None:
            limit.pop()
    for ph in list(tree.find_all(exp.Placeholder)):
        name = ph.name
        if name not in types:
            raise KeyError(f"SQL names ${name} but no value is bound for it")
        ph.replace(exp.Null() if types[name] is None else exp.var(f"{{{name}:{types[name]}}}"))
    tree = tree.transform(_rewrite, copy=False)
    for select in list(tree.find_all(exp.Select)):
        _unnest_to_array_join(select)
        _name_qualified_columns(select)
    for select in reversed(list(tree.find_all(exp.Select))):  # innermost first: a wrap copies its subtree
        sorted_outside = _order_by_aliases(select)
        if select is tree and sorted_outside is not None:
            tree = sorted_outside
    return _Generator().generate(tree)


def _t(node):
    """``node`` rewritten: a rule that builds a new node rewrites the children it keeps
    (sqlglot's transform does not visit nodes a rule returned)."""
    return node.transform(_rewrite, copy=False) if node is not None else None


def _rewrite(node):
    from sqlglot import exp

    if isinstance(node, exp.IntDiv):
        return exp.Anonymous(this="intDiv", expressions=[_t(node.this), _t(node.expression)])
    if isinstance(node, exp.Filter) and isinstance(node.this, exp.Count):
        cond = _t(node.expression.this if isinstance(node.expression, exp.Where) else node.expression)
        arg = _t(node.this.this)
        if arg is not None and not isinstance(arg, exp.Star):
            cond = exp.and_(exp.Not(this=exp.Is(this=arg.copy(), expression=exp.Null())), cond)
        return _int64(exp.Anonymous(this="countIf", expressions=[cond]))
    if isinstance(node, exp.Window) and isinstance(node.this, (exp.Count, exp.RowNumber)):
        if _is_int64_wrapped(node):
            return node
        for key in ("partition_by", "order"):  # kept inside the new node: rewrite them here
            value = node.args.get(key)
            if isinstance(value, list):
                node.set(key, [_t(v) for v in value])
            elif value is not None:
                node.set(key, _t(value))
        if isinstance(node.this, exp.Count) and node.this.this is not None:
            node.this.set("this", _t(node.this.this))
        return _int64(node)  # toInt64(count() OVER ...)
    if isinstance(node, exp.Count):
        if isinstance(node.parent, (exp.Filter, exp.Window)) or _is_int64_wrapped(node):
            return node
        if node.this is not None:
            node.set("this", _t(node.this))
        return _int64(node)
    if isinstance(node, exp.Length):
        return _int64(exp.Anonymous(this="length", expressions=[_t(node.this)]))
    if isinstance(node, exp.GenerateSeries) and node.args.get("is_end_exclusive"):
        args = [_t(node.args["start"]), _t(node.args["end"])]
        rng = exp.Anonymous(this="range", expressions=args)
        return exp.Anonymous(this="arrayMap", expressions=[exp.var("x -> toInt64(x)"), rng])
    if isinstance(node, exp.Median):
        return exp.ParameterizedAgg(this="quantileExactInclusive", expressions=[exp.Literal.number(0.5)],
                                    params=[_t(node.this)])
    if isinstance(node, (exp.Lag, exp.Lead)):
        node.set("this", exp.Anonymous(this="toNullable", expressions=[_t(node.this)]))
        return node
    if isinstance(node, exp.ArrayPosition) or (isinstance(node, exp.Anonymous)
                                                 and node.name.lower() == "list_position"):
        args = [node.this, node.expression] if not isinstance(node, exp.Anonymous) else node.expressions
        found = exp.Anonymous(this="indexOf", expressions=[_t(a) for a in args])  # 0 when absent
        return exp.Anonymous(this="CAST", expressions=[exp.Anonymous(this="nullIf", expressions=[
            found, exp.Literal.number(0)]), exp.Literal.string("Nullable(Int32)")])
    if isinstance(node, exp.ArrayContains):  # has() is UInt8; list_contains a BOOLEAN
        return exp.Anonymous(this="toBool", expressions=[exp.Anonymous(this="has", expressions=[
            _t(node.this), _t(node.expression)])])
    if isinstance(node, exp.Join) and (node.args.get("kind") or "").upper() == "SEMI" and not node.side:
        node.set("side", "LEFT")
        return node
    if isinstance(node, exp.Table) and isinstance(node.this, exp.GenerateSeries):
        return _numbers_table(node)
    if isinstance(node, exp.Table) and isinstance(node.this, exp.Anonymous) and node.this.name == "duckdb_tables":
        import sqlglot

        sub = sqlglot.parse_one("SELECT name AS table_name FROM system.tables WHERE database = currentDatabase()",
                                read="clickhouse")
        alias = node.args.get("alias") or exp.TableAlias(this=exp.to_identifier("duckdb_tables"))
        return exp.Subquery(this=sub, alias=alias)
    return node


def _int64(node):
    from sqlglot import exp

    return exp.Anonymous(this="toInt64", expressions=[node])


def _is_int64_wrapped(node) -> bool:
    from sqlglot import exp

    parent = node.parent
    return isinstance(parent, exp.Anonymous) and parent.name == "toInt64"


def _numbers_table(table):
    """``range(N) AS t(r)`` (DuckDB's table function) -> ``(SELECT number AS r FROM numbers(N)) AS t``."""
    import sqlglot
    from sqlglot import exp

    series = table.this
    alias = table.args.get("alias")
    name = alias.name if alias is not None else "t"
    cols = [c.name for c in alias.columns] if alias is not None and alias.columns else ["range"]
    start, end = series.args["start"], series.args["end"]
    sub = sqlglot.parse_one(f"SELECT toInt64(number) AS {cols[0]} FROM numbers(1)", read="clickhouse")
    numbers = sub.find(exp.Table)
    count = exp.Sub(this=end.copy(), expression=start.copy())
    numbers.replace(exp.Table(this=exp.Anonymous(this="numbers", expressions=[start.copy(), count])))
    return exp.Subquery(this=sub, alias=exp.TableAlias(this=exp.to_identifier(name)))


def _order_by_aliases(select):
    """DuckDB's ORDER BY name means the output column of that name first; with
    ``prefer_column_name_to_alias`` ClickHouse would take the input column. Such a query
    is sorted outside: ``SELECT * FROM (query) ORDER BY ... LIMIT ...``, where only the
    output columns exist (a positional ORDER BY trips ClickHouse 26.9's planner on
    grouped IN-subquery keys); where the ORDER BY also names other columns, the alias
    becomes its position."""
    from sqlglot import exp

    order = select.args.get("order")
    if order is None:
        return None
    aliases = {p.alias: i + 1 for i, p in enumerate(select.expressions) if isinstance(p, exp.Alias)}
    refs = [c for item in order.expressions for c in item.find_all(exp.Column)]
    if not any(not c.table and c.name in aliases for c in refs):
        return None
    outputs = set(aliases) | {p.name for p in select.expressions if isinstance(p, exp.Column)}
    wrappable = (not any(isinstance(p, exp.Star) or (isinstance(p, exp.Column) and isinstance(p.this, exp.Star))
                         for p in select.expressions)
                 and all(not c.table and c.name in outputs for c in refs)
                 and not isinstance(select.parent, (exp.Union, exp.Intersect, exp.Except)))
    if not wrappable:
        for c in refs:
            if not c.table and c.name in aliases:
                c.replace(exp.Literal.number(aliases[c.name]))
        return None
    limit, offset, with_ = select.args.get("limit"), select.args.get("offset"), select.args.get("with_")
    inner = select.copy()
    for key in ("order", "limit", "offset", "with_"):
        inner.set(key, None)
    outer = exp.Select(expressions=[exp.Star()]).from_(exp.Subquery(this=inner, alias=exp.TableAlias(
        this=exp.to_identifier("_kv_sorted"))))
    outer.set("order", order.copy())
    for key, value in (("limit", limit), ("offset", offset), ("with_", with_)):
        if value is not None:
            outer.set(key, value.copy())
    select.replace(outer)
    return outer


def _name_qualified_columns(select) -> None:
    """``SELECT r.run_id`` is column ``run_id`` in DuckDB, ``r.run_id`` in ClickHouse."""
    from sqlglot import exp

    for proj in select.expressions:
        if isinstance(proj, exp.Column) and proj.table and not isinstance(proj.this, exp.Star):
            proj.replace(exp.Alias(this=proj.copy(), alias=exp.to_identifier(proj.name)))


def _unnest_to_array_join(select) -> None:
    """DuckDB's select-list ``unnest(x) AS a, unnest(y) AS b`` (zipped) -> ClickHouse's
    ``... ARRAY JOIN x AS _kv_a0, y AS _kv_a1`` with the projections reading the aliases."""
    from sqlglot import exp

    explodes = [e for e in select.expressions if isinstance(e.unalias(), exp.Explode)]
    if not explodes:
        return
    joined = []
    for i, proj in enumerate(explodes):
        node = proj.unalias()
        inner = f"_kv_a{i}"
        joined_list = node.this.copy()
        if len(explodes) > 1:  # zipped: a shorter list is padded with its element's default, DuckDB's with NULL
            joined_list = exp.Anonymous(this="arrayMap", expressions=[
                exp.Lambda(this=exp.Anonymous(this="toNullable", expressions=[exp.column("_kv_e")]),
                           expressions=[exp.to_identifier("_kv_e")]),
                joined_list])
        joined.append(exp.Alias(this=joined_list, alias=exp.to_identifier(inner)))
        node.replace(exp.column(inner))
    for other in select.expressions:  # unnest nested deeper than the projection itself
        if other.find(exp.Explode):
            raise ValueError("to_clickhouse: unnest() must be a whole select-list item")
    join = exp.Join(this=joined[0], expressions=joined[1:], kind="ARRAY")
    select.append("joins", join)


def _generator_class():
    from sqlglot import exp
    from sqlglot.dialects.clickhouse import ClickHouse

    base = ClickHouse.Generator

    def cast_sql(self, expression, safe_prefix=None):
        to = expression.to
        if to.is_type(exp.DType.ARRAY) and isinstance(expression.this, exp.Null):
            return f"CAST([] AS {self._ch_type(to)})"
        return f"CAST({self.sql(expression, 'this')} AS {self._ch_type(to)})"

    def ch_type(self, dtype) -> str:
        # DuckDB's type spelling of this DataType, mapped by clickhouse_type (arrays
        # non-Nullable, scalars Nullable: a cast may meet NULL)
        return clickhouse_type(dtype.sql("duckdb"))

    def try_cast_sql(self, expression, safe_prefix=None):
        # NULL where the value does not convert, as DuckDB's TRY_CAST
        target = clickhouse_type(expression.to.sql("duckdb"), nullable=False)
        return f"accurateCastOrNull({self.sql(expression, 'this')}, '{target}')"

    transforms = dict(base.TRANSFORMS)
    transforms[exp.Cast] = cast_sql
    transforms[exp.TryCast] = try_cast_sql
    return type("KVTraceClickHouseGenerator", (base,), {"TRANSFORMS": transforms, "_ch_type": ch_type})


@functools.cache
def _generator_type():
    return _generator_class()


def _Generator():
    return _generator_type()(pretty=False, normalize_functions=False, dialect="clickhouse")


def settings_clause() -> str:
    """``SETTINGS ...`` for the end of a query text (chdb takes settings only there)."""
    return "SETTINGS " + ", ".join(f"{k} = {v}" for k, v in QUERY_SETTINGS.items())
