"""The admin API: keys made, listed, shown, changed and revoked at run time, and their usage.

Every route wants ``Authorization: Bearer <TOKENSPOUT_ADMIN_KEY>`` (401 without it; 403
while no admin key is configured). A change is in force on every gateway replica within a
second (gateway/tenants/directory.py).

| method and path | answer |
| --- | --- |
| ``POST /v1/admin/keys`` | 201 the key, with its secret ``key`` (shown this once) |
| ``GET /v1/admin/keys`` | 200 ``{"keys": [...]}``, revoked ones too |
| ``GET /v1/admin/keys/{id}`` | 200 the key |
| ``PATCH /v1/admin/keys/{id}`` | 200 the key changed (name, models, weight, limits) |
| ``DELETE /v1/admin/keys/{id}`` | 200 the key, revoked (its record and usage stay); 409 again |
| ``GET /v1/admin/usage?key=&start=&end=&granularity=hour|day`` | 200 its usage |
"""

from __future__ import annotations

from typing import Annotated

from litestar import Response, Router, delete, get, patch, post
from litestar.params import Parameter

from gateway.apis.admin.views import (
    KeyList,
    KeyView,
    UsageReport,
    check_json_types,
    usage_report,
)
from gateway.core.auth import admin_key_check
from gateway.core.errors import (
    AnyRequest,
    BadRequest,
    Conflict,
    ErrorEnvelope,
    GatewayError,
    NotFound,
)
from gateway.core.service import GatewayService
from gateway.tenants.keystore import KeyRevoked, KeyStore, TenantsError, UnknownKey
from gateway.tenants.records import KEY_ID_PREFIX, KeyChange, NewKey


def _keys(service: GatewayService) -> KeyStore:
    return service.tenant_directory.store


@post("/keys", status_code=201, summary="Make an API key (its secret is shown once)")
async def create_key(service: GatewayService, request: AnyRequest, data: NewKey) -> KeyView:
    check_json_types(NewKey, await request.body())
    record, secret = await _keys(service).create(data)
    return KeyView.of(record, secret)


@get("/keys", summary="Every API key made at run time, revoked ones too")
async def list_keys(service: GatewayService) -> KeyList:
    return KeyList([KeyView.of(record) for record in await _keys(service).all()])


@get("/keys/{key_id:str}", summary="One API key")
async def show_key(service: GatewayService, key_id: str) -> KeyView:
    return KeyView.of(await _keys(service).get(key_id))


@patch("/keys/{key_id:str}", summary="Change an API key's name, models, weight or limits")
async def update_key(
    service: GatewayService, request: AnyRequest, key_id: str, data: KeyChange
) -> KeyView:
    check_json_types(KeyChange, await request.body())
    return KeyView.of(await _keys(service).update(key_id, data))


@delete("/keys/{key_id:str}", status_code=200, summary="Revoke an API key")
async def revoke_key(service: GatewayService, key_id: str) -> KeyView:
    return KeyView.of(await _keys(service).revoke(key_id))


@get("/usage", summary="A key's usage per UTC hour or day")
async def usage(
    service: GatewayService,
    key: Annotated[str, Parameter(description="a key's id, a static key's, or anonymous")],
    start: str | None = None,
    end: str | None = None,
    granularity: str = "hour",
) -> UsageReport:
    """``start``, ``end``: unix seconds or ISO 8601 (UTC unless it says otherwise); the
    default range is the last day by hour, the last 30 days by day."""
    if not key.startswith(KEY_ID_PREFIX) and service.tenant_directory.by_id(key) is None:
        raise UnknownKey(key)  # neither made at run time, static, nor anonymous
    return await usage_report(_keys(service), key, granularity, start, end)


def _as_gateway_error(exc: TenantsError) -> GatewayError:
    match exc:
        case UnknownKey():
            return NotFound(str(exc), code=exc.code)
        case KeyRevoked():
            return Conflict(str(exc), code=exc.code)
    return BadRequest(str(exc), code=exc.code, field=exc.field)


def admin_error(_: AnyRequest, exc: TenantsError) -> Response[ErrorEnvelope]:
    """The keys store's refusals in the gateway's error format (every other error: the
    app's handler)."""
    error = _as_gateway_error(exc)
    return Response(error.body(), status_code=error.status)


admin_router = Router(
    path="/v1/admin",
    route_handlers=[create_key, list_keys, show_key, update_key, revoke_key, usage],
    tags=["admin"],
    before_request=admin_key_check,
    exception_handlers={TenantsError: admin_error},
)
