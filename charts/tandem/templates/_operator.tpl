{{/*
How the chart starts `tandem operator`: its arguments, settings and liveness endpoint.
Kept in one place; they follow docs/operator.md ("Running it").
*/}}

{{- define "tandem.operatorHealthPort" -}}8080{{- end -}}
{{- define "tandem.operatorHealthPath" -}}/healthz{{- end -}}

{{- define "tandem.operatorArgs" -}}
- operator
{{- end -}}

{{- define "tandem.operatorEnv" -}}
- name: TANDEM_OPERATOR_NAMESPACES
  value: {{ join "," .Values.operator.watchNamespaces | quote }}
- name: TANDEM_OPERATOR_PEERING
  value: {{ ternary .Values.peering.name "" .Values.peering.create | quote }}
- name: TANDEM_OPERATOR_LIVENESS_PORT
  value: {{ include "tandem.operatorHealthPort" . | quote }}
{{- end -}}
