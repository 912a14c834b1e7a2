"""The project's own Conveyor router, served by manage.py conveyor_worker beside the tasks."""

from conveyor import Router

router = Router()


@router.route("shop.audit", store_result=True)
def audit(event):  # type: ignore[no-untyped-def]
    return {"audited": event.payload}
