# EC2 reclaim events -> the spotrain webhook (EventBridge API destination) and/or an SQS queue
# the webhook polls (queue mode). Both paths carry the EventBridge event id, so an event that
# arrives by both has one effect on the job. Every permission names exactly one resource.

locals {
  api_destination = var.webhook_url != ""
  tags            = merge({ "spotrain" = "true", "spotrain:component" = "reclaim-webhook" }, var.tags)
  # Interruption warnings (spot, capacity reservation) and early warnings (rebalance
  # recommendations, AWS Health scheduled changes for EC2); instances stopping or terminating.
  patterns = {
    spot   = file("${path.module}/patterns/spot.json")
    state  = file("${path.module}/patterns/state.json")
    health = file("${path.module}/patterns/health.json")
  }
}

resource "aws_cloudwatch_event_rule" "reclaims" {
  for_each      = local.patterns
  name          = "${var.name}-${each.key}"
  description   = "spotrain: ${each.key} events for the reclaim webhook"
  event_pattern = each.value
  tags          = local.tags
}

# Events EventBridge could not deliver (webhook down past the retry window) land here.
resource "aws_sqs_queue" "dead_letters" {
  name                      = "${var.name}-dlq"
  message_retention_seconds = 1209600
  sqs_managed_sse_enabled   = true
  tags                      = local.tags
}

# --- queue mode --------------------------------------------------------------------------------

resource "aws_sqs_queue" "reclaims" {
  count                      = var.enable_queue ? 1 : 0
  name                       = var.name
  message_retention_seconds  = 3600
  visibility_timeout_seconds = 30
  receive_wait_time_seconds  = 10
  sqs_managed_sse_enabled    = true
  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.dead_letters.arn
    maxReceiveCount     = 20
  })
  tags = local.tags
}

data "aws_iam_policy_document" "queue" {
  count = var.enable_queue ? 1 : 0
  statement {
    sid       = "EventBridgeSendsOurRulesOnly"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.reclaims[0].arn]
    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }
    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [for rule in aws_cloudwatch_event_rule.reclaims : rule.arn]
    }
  }
}

resource "aws_sqs_queue_policy" "reclaims" {
  count     = var.enable_queue ? 1 : 0
  queue_url = aws_sqs_queue.reclaims[0].id
  policy    = data.aws_iam_policy_document.queue[0].json
}

data "aws_iam_policy_document" "dead_letters" {
  statement {
    sid       = "EventBridgeDeadLettersOurRulesOnly"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.dead_letters.arn]
    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }
    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [for rule in aws_cloudwatch_event_rule.reclaims : rule.arn]
    }
  }
}

resource "aws_sqs_queue_policy" "dead_letters" {
  queue_url = aws_sqs_queue.dead_letters.id
  policy    = data.aws_iam_policy_document.dead_letters.json
}

resource "aws_cloudwatch_event_target" "queue" {
  for_each  = var.enable_queue ? aws_cloudwatch_event_rule.reclaims : {}
  rule      = each.value.name
  target_id = "spotrain-queue"
  arn       = aws_sqs_queue.reclaims[0].arn
  dead_letter_config {
    arn = aws_sqs_queue.dead_letters.arn
  }
}

# The webhook in queue mode may read and delete from its queue, nothing else.
data "aws_iam_policy_document" "consumer" {
  count = var.enable_queue ? 1 : 0
  statement {
    sid       = "PollReclaimQueue"
    actions   = ["sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes"]
    resources = [aws_sqs_queue.reclaims[0].arn]
  }
}

resource "aws_iam_policy" "consumer" {
  count       = var.enable_queue ? 1 : 0
  name        = "${var.name}-consumer"
  description = "spotrain webhook: poll the reclaim queue"
  policy      = data.aws_iam_policy_document.consumer[0].json
  tags        = local.tags
}

resource "aws_iam_role_policy_attachment" "consumer" {
  count      = var.enable_queue && var.webhook_role_name != "" ? 1 : 0
  role       = var.webhook_role_name
  policy_arn = aws_iam_policy.consumer[0].arn
}

# --- API destination: EventBridge POSTs each event to the webhook ----------------------------

resource "aws_cloudwatch_event_connection" "webhook" {
  count              = local.api_destination ? 1 : 0
  name               = var.name
  description        = "spotrain webhook bearer token"
  authorization_type = "API_KEY"
  lifecycle {
    precondition {
      condition     = var.webhook_token != ""
      error_message = "webhook_url is set: webhook_token must be too (the webhook refuses unauthenticated events)."
    }
  }
  auth_parameters {
    api_key {
      key   = "Authorization"
      value = "Bearer ${var.webhook_token}"
    }
  }
}

resource "aws_cloudwatch_event_api_destination" "webhook" {
  count                            = local.api_destination ? 1 : 0
  name                             = var.name
  description                      = "spotrain reclaim webhook"
  invocation_endpoint              = "${trimsuffix(var.webhook_url, "/")}/v1/events/aws"
  http_method                      = "POST"
  invocation_rate_limit_per_second = 50
  connection_arn                   = aws_cloudwatch_event_connection.webhook[0].arn
}

data "aws_iam_policy_document" "events_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "invoke" {
  count              = local.api_destination ? 1 : 0
  name               = "${var.name}-invoke"
  assume_role_policy = data.aws_iam_policy_document.events_assume.json
  tags               = local.tags
}

data "aws_iam_policy_document" "invoke" {
  count = local.api_destination ? 1 : 0
  statement {
    sid       = "InvokeTheWebhookOnly"
    actions   = ["events:InvokeApiDestination"]
    resources = ["${aws_cloudwatch_event_api_destination.webhook[0].arn}/*"]
  }
}

resource "aws_iam_role_policy" "invoke" {
  count  = local.api_destination ? 1 : 0
  name   = "invoke-webhook"
  role   = aws_iam_role.invoke[0].id
  policy = data.aws_iam_policy_document.invoke[0].json
}

resource "aws_cloudwatch_event_target" "webhook" {
  for_each  = local.api_destination ? aws_cloudwatch_event_rule.reclaims : {}
  rule      = each.value.name
  target_id = "spotrain-webhook"
  arn       = aws_cloudwatch_event_api_destination.webhook[0].arn
  role_arn  = aws_iam_role.invoke[0].arn
  # A notice is useful for ~2 minutes: retry (the webhook answers 503 while Temporal is down)
  # within that, then dead-letter.
  retry_policy {
    maximum_event_age_in_seconds = 120
    maximum_retry_attempts       = 20
  }
  dead_letter_config {
    arn = aws_sqs_queue.dead_letters.arn
  }
}
