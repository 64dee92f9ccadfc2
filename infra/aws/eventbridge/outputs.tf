output "queue_url" {
  description = "SPOTRAIN_WEBHOOK_QUEUE_URL for queue mode (null when disabled)."
  value       = var.enable_queue ? aws_sqs_queue.reclaims[0].url : null
}

output "consumer_policy_arn" {
  description = "Attach to the webhook's role (IRSA) for queue mode."
  value       = var.enable_queue ? aws_iam_policy.consumer[0].arn : null
}

output "dead_letter_queue_url" {
  value = aws_sqs_queue.dead_letters.url
}

output "rule_arns" {
  value = { for k, rule in aws_cloudwatch_event_rule.reclaims : k => rule.arn }
}
