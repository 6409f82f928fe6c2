"""The pipeline's notices, sent: one message when a scheduled run's challenger is worse than the champion or a
pipeline run fails (grpo_core/pipeline/notices.py decides when), so nobody has to read last night's runs to learn it.

Sent through Prefect's notification blocks, never hand-written HTTP: ``tracking.notify_block`` names a saved
block (``TYPE/NAME``, e.g. ``slack-webhook/ml-alerts``); ``tracking.notify_webhook_url`` is posted to by a
``CustomWebhookNotificationBlock`` made on the spot (JSON ``{"text": body, "subject": subject}``, which Slack's
and most chat webhooks read). The URL is a secret (its path is often the token): it is never logged or printed,
and a failure to send is one warning without it. A notice that cannot be sent never fails the run.
"""

import logging
import re

logger = logging.getLogger(__name__)
BLOCK_NAME = re.compile(r"^[a-z0-9-]+/[A-Za-z0-9_-]+$")  # Prefect's block-type slug / block name
WEBHOOK_JSON = {"text": "{{body}}", "subject": "{{subject}}"}


def target_problems(url: str | None, block: str | None) -> list[str]:
    """Config errors of the notice's targets, one line each, never showing the URL itself."""
    from urllib.parse import urlsplit

    problems = []
    if url is not None:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  (parsed when read: a port that is no number in 0-65535 raises ValueError)
        except ValueError:  # a malformed host ("[" unclosed, characters NFKC changes) or port; its text may be secret
            parts = None
        hidden = "the value is not shown: a webhook URL may hold a token"
        if parts is None:
            problems.append(f"tracking.notify_webhook_url: not a URL: its host or port cannot be parsed ({hidden})")
        elif parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"tracking.notify_webhook_url: not an http:// or https:// URL with a host ({hidden})")
    if block is not None and not BLOCK_NAME.match(block):
        problems.append(
            f"tracking.notify_block={block!r}: write a Prefect block as TYPE/NAME, e.g. slack-webhook/ml-alerts "
            "(`prefect block ls` lists them)"
        )
    return problems


def send_notice(subject: str, body: str, url: str | None = None, block: str | None = None) -> int:
    """Send the notice to each configured target; how many took it. Failures are warnings (without the URL)."""
    sent = 0
    for what, make in (("tracking.notify_block", _saved_block), ("tracking.notify_webhook_url", _webhook_block)):
        target = block if what == "tracking.notify_block" else url
        if not target:
            continue
        try:
            make(target).notify(body, subject)
        except Exception as e:  # noqa: BLE001  (a notice never fails the run)
            status = getattr(getattr(e, "response", None), "status_code", None)
            shown = f"HTTP {status}" if status else type(e).__name__
            logger.warning("warning: the pipeline's notice was not sent to %s (%s)", what, shown)
        else:
            sent += 1
    return sent


def _saved_block(name: str):
    from prefect.blocks.core import Block
    from prefect.blocks.notifications import NotificationBlock

    block = Block.load(name)
    if not isinstance(block, NotificationBlock):
        raise TypeError(f"{name} is not a notification block")
    return block


def _webhook_block(url: str):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    return CustomWebhookNotificationBlock(name="grpo-pipeline", url=url, json_data=WEBHOOK_JSON)
