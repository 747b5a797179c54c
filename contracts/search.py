"""Search attributes: the keys every workflow carries and the sets each kind starts with.

Listing (api/listing.py) filters on these; the control worker's workflows set them; the stack
registers them with the Temporal server (`common.settings.SEARCH_ATTRIBUTES`).
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

from contracts.records import Gateway, HotLoad

ORG = SearchAttributeKey.for_keyword("OrganizationId")
DEPLOYMENT = SearchAttributeKey.for_keyword("DeploymentId")
GATEWAY = SearchAttributeKey.for_keyword("GatewayId")
KIND = SearchAttributeKey.for_keyword("ResourceKind")
IDENTITY = SearchAttributeKey.for_keyword("HotLoadIdentity")
STATE = SearchAttributeKey.for_keyword("HotLoadState")
TYPE = SearchAttributeKey.for_keyword("HotLoadType")


def deployment_attributes(organization_id: str, deployment_id: str) -> TypedSearchAttributes:
    return TypedSearchAttributes(
        [
            SearchAttributePair(ORG, organization_id),
            SearchAttributePair(DEPLOYMENT, deployment_id),
            SearchAttributePair(KIND, "deployment"),
        ]
    )


def gateway_attributes(gateway: Gateway) -> TypedSearchAttributes:
    return TypedSearchAttributes(
        [
            SearchAttributePair(ORG, gateway.spec.organization_id),
            SearchAttributePair(GATEWAY, gateway.spec.id),
            SearchAttributePair(KIND, "gateway"),
        ]
    )


def hot_load_attributes(hot_load: HotLoad) -> TypedSearchAttributes:
    spec = hot_load.spec
    return TypedSearchAttributes(
        [
            SearchAttributePair(ORG, spec.organization_id),
            SearchAttributePair(DEPLOYMENT, spec.deployment_id),
            SearchAttributePair(KIND, "hotLoad"),
            SearchAttributePair(IDENTITY, spec.identity),
            SearchAttributePair(STATE, hot_load.status.state.value),
            SearchAttributePair(TYPE, spec.type.value),
        ]
    )
