{{/* Labels every object of the release carries. */}}
{{- define "stratamq.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator's name: its ServiceAccount, ClusterRole(Binding), Deployment and
     peering object are all called this. */}}
{{- define "stratamq.operatorName" -}}
{{ .Release.Name }}-stratamq-operator
{{- end -}}

{{/* The ClusterRole the operator binds each storage's Spark driver account to. */}}
{{- define "stratamq.sparkDriverRole" -}}
{{ .Release.Name }}-stratamq-spark
{{- end -}}

{{- define "stratamq.operatorSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The PriorityClass of the operator's pods: the values' name, else the chart's own. */}}
{{- define "stratamq.operatorPriorityClass" -}}
{{- if .Values.operator.priorityClassName -}}
{{ .Values.operator.priorityClassName }}
{{- else if .Values.operator.priorityClass.create -}}
{{ include "stratamq.operatorName" . }}
{{- end -}}
{{- end -}}

{{/* What the operator's pods and its uninstall hook's pods share (the one image, the
     network, the confinement Pod Security "restricted" asks for, a writable /tmp):
     the hook must run wherever the operator runs. */}}
{{- define "stratamq.operatorImage" -}}
"{{ .Values.operator.image.repository }}:{{ .Values.operator.image.tag | default .Chart.AppVersion }}"
{{- end -}}

{{/* On the node's network, when asked (nodes without a pod network). */}}
{{- define "stratamq.operatorNetwork" -}}
{{- if .Values.operator.hostNetwork -}}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end -}}
{{- end -}}

{{- define "stratamq.operatorPodSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "stratamq.operatorContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The root filesystem is read-only; the Kubernetes client keeps its discovery cache
     under /tmp. */}}
{{- define "stratamq.operatorTmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end -}}
